"""Proposers for speculative decoding: per step, a draft of each row's continuation for the base
model to verify (specee_core.spec.acceptance), as a token tree.

- DraftHeadProposer: the EAGLE-style draft head. A chain (width 1) or an EAGLE-2 tree: level by
  level, the `width` nodes with the highest cumulative draft log-probability are expanded into
  their `width` most likely children; at the end the `nodes` best of all drafted nodes form the tree.
- LookupProposer: prompt lookup (n-gram), training-free; chains.

A draft's node 0 is the row's root: the token the last step chose, not yet fed. Node j's parent is
parent[j] < j, and node j sits at position prefix + depth(j).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from specee_core.step.sampling import SamplingParams, probabilities
from specee_core.early_exit.speculators import ngram_matches

if TYPE_CHECKING:
    from specee_core.step.state import Batch
    from specee_core.step.stepper import StepEngine
    from specee_core.early_exit.speculators import DraftSpeculator


@dataclass
class Draft:
    tokens: torch.Tensor  # [N, T] node tokens; node 0 = the root
    parent: torch.Tensor  # [N, T] parent node (-1 for the root and for padding); parent[j] < j
    valid: torch.Tensor  # [N, T] bool; rows with fewer nodes are padded
    # [N, T, V] the distribution node j's token was drawn from (row 0 unused); None: deterministic
    # drafts (the draft head's top tokens, prompt lookup)
    q: torch.Tensor | None = None
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


class Proposer(Protocol):
    def start(self, engine: StepEngine, batch: Batch, cache, prefill_hidden: torch.Tensor, lens: torch.Tensor) -> None:
        """After the prefill; prefill_hidden [B, T, D] right-padded, lens [B]."""

    def admit(self, batch: Batch, rows: list[int], prefill_hidden: torch.Tensor, lens: torch.Tensor) -> None:
        """Continuous batching: batch rows `rows` start new prompts, prefilled (as start, for those rows)."""

    def caches(self) -> list:
        """The KV caches it keeps (a draft head's), which grow with the target's."""
        ...

    def propose(self, rows: list[int], batch: Batch, depths: list[int], params: SamplingParams | None = None,
                generator: torch.Generator | None = None, max_nodes: int | None = None) -> Draft:
        """Drafts after each row's root (its last generated token), no deeper than depths[r] (>= 1 for
        some row) and with at most max_nodes drafted nodes of a tree per row (None: the proposer's own)."""
        ...

    def accepted(self, rows: list[int], features: list[torch.Tensor], tokens: list[list[int]]) -> None:
        """features[r] [a + 1, D]: the verified (final-normed) features of row r's root and accepted
        nodes; tokens[r]: the tokens that followed them (the accepted nodes' and the bonus token).
        Called after every step, also those for which nothing was proposed."""


class LookupProposer:
    """Prompt lookup (n-gram) drafting, training-free: the tokens that followed the latest earlier
    occurrence of the row's last n tokens (n = max_ngram..1) in its prompt and output."""

    def __init__(self, max_ngram: int = 3):
        self.max_ngram = max_ngram

    def start(self, engine, batch, cache, prefill_hidden: torch.Tensor, lens: torch.Tensor) -> None:
        pass

    def admit(self, batch, rows: list[int], prefill_hidden: torch.Tensor, lens: torch.Tensor) -> None:
        pass  # drafts from the batch's tokens alone

    def caches(self) -> list:
        return []

    def continuation(self, hist: list[int], depth: int) -> list[int]:
        start = next(ngram_matches(hist, self.max_ngram), None)
        return [] if start is None else hist[start : start + depth]

    def propose(self, rows: list[int], batch, depths: list[int], params: SamplingParams | None = None,
                generator: torch.Generator | None = None, max_nodes: int | None = None) -> Draft:
        conts = [self.continuation(batch.prompt_ids[b] + batch.generated[b], d) if d > 0 else []
                 for b, d in zip(rows, depths)]
        return Draft.chains([batch.generated[b][-1] for b in rows], conts)

    def accepted(self, rows: list[int], features: list[torch.Tensor], tokens: list[list[int]]) -> None:
        pass


@dataclass
class TreeShape:
    depth: int  # levels below the root
    width: int  # nodes expanded per level, and children drafted per expanded node (EAGLE-2's top-k)
    nodes: int  # drafted nodes kept (the root excluded)


class DraftHeadProposer:
    """Drafts from the EAGLE-style draft head: each draft step pairs a token with the feature before
    it and predicts the next feature, whose LM-head distribution ranks the next tokens.

    The draft's KV cache holds only pairs with true base features: entries for drafted tokens are
    dropped after each step, and the next step first feeds the newly committed tokens with their
    verified features. Inside a step the drafted levels attend to their own ancestors (tree mask)."""

    def __init__(self, speculator: DraftSpeculator, shape: TreeShape, lookup: LookupProposer | None = None,
                 lookup_first: bool = False):
        # lookup: its chain joins the tree; lookup_first: a row whose lookup finds a continuation takes that
        # chain alone (no draft forward: the row's pairs stay pending), the others the draft head's
        # its own fork: the draft cache is per proposer (per batch), the weights are shared
        self.spec, self.shape, self.lookup, self.lookup_first = speculator.fork(), shape, lookup, lookup_first

    def start(self, engine, batch, cache, prefill_hidden: torch.Tensor, lens: torch.Tensor) -> None:
        m = engine.model
        self.spec.start(batch.prompt_ids, m.final_norm(prefill_hidden), lens, cache.max_len)
        n = len(batch.prompt_ids)
        # pending true pairs per row: (token x_{i+1}, feature f_i) from the draft cache's length on
        self.pend_tokens = [[int(t)] for t in batch.next_tokens.tolist()]
        # per row: the features of its pending pairs, one [k, D] tensor per step (joined when fed, so steps
        # without a draft append without copying)
        self.pend_feats = [[m.final_norm(batch.last_hidden[b : b + 1])] for b in range(n)]

    def caches(self) -> list:
        return self.spec.caches()

    def admit(self, batch, rows: list[int], prefill_hidden: torch.Tensor, lens: torch.Tensor) -> None:
        """New prompts in batch rows `rows` (continuous batching): prefill their draft cache rows and
        set their pending pairs, as start does for a whole batch."""
        m = self.spec.model_base
        self.spec.admit([batch.context(b) for b in rows], m.final_norm(prefill_hidden), lens, rows)
        for b in rows:
            self.pend_tokens[b] = [int(batch.next_tokens[b])]
            self.pend_feats[b] = [m.final_norm(batch.last_hidden[b : b + 1])]

    def accepted(self, rows: list[int], features: list[torch.Tensor], tokens: list[list[int]]) -> None:
        for b, f, toks in zip(rows, features, tokens):  # steps without a draft leave their pairs pending
            self.pend_tokens[b] += toks
            self.pend_feats[b].append(f)

    def propose(self, rows: list[int], batch, depths: list[int], params: SamplingParams | None = None,
                generator: torch.Generator | None = None, max_nodes: int | None = None) -> Draft:
        """A tree of the draft's most likely tokens (deterministic, q None). Sampling with width 1
        draws a chain from the draft's distribution instead, recorded in q for rejection sampling."""
        greedy = params is None or params.greedy
        if self.lookup is not None and self.lookup_first and greedy:
            conts = [self.lookup.continuation(batch.prompt_ids[b] + batch.generated[b], d) if d > 0 else []
                     for b, d in zip(rows, depths)]
            found = [r for r, c in enumerate(conts) if c]
            if found:
                chains = Draft.chains([batch.generated[rows[r]][-1] for r in found], [conts[r] for r in found])
                rest = [r for r, c in enumerate(conts) if not c]
                if not rest:
                    return chains
                tree = self._propose([rows[r] for r in rest], batch, [depths[r] for r in rest], params, generator,
                                     max_nodes)
                return Draft.by_rows(len(rows), [(found, chains), (rest, tree)])
        return self._propose(rows, batch, depths, params, generator, max_nodes)

    def _propose(self, rows, batch, depths, params, generator, max_nodes) -> Draft:
        roots = [batch.generated[b][-1] for b in rows]
        synced, counts, f = self._feed_pending(rows)
        if max(depths) == 0:  # every row is one token from its end: the base's token alone
            return Draft.chains(roots, [[] for _ in rows])
        base = synced + counts  # [N] host: the draft cache slot of the first drafted node
        try:
            if params is not None and not params.greedy and self.shape.width == 1:
                return self._sampled_chain(rows, roots, depths, f, base, params, generator)
            tree = self._tree(rows, roots, depths, f, base, max_nodes or self.shape.nodes)
            if self.lookup is None or self.lookup_first:
                return tree
            return tree.with_chains([self.lookup.continuation(batch.prompt_ids[b] + batch.generated[b], d)
                                     if d > 0 else [] for b, d in zip(rows, depths)])
        finally:
            self.spec.truncate(torch.tensor(rows), base)  # drop the drafted pairs: their features were guesses

    def _feed_pending(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Feed each row's pending true pairs; returns (synced [N], counts [N]: the draft cache length
        before and the pairs fed, f [N, D]: the predicted feature after each row's last pair = its root's)."""
        toks = [self.pend_tokens[b] for b in rows]
        feats = [torch.cat(self.pend_feats[b]) for b in rows]
        for b in rows:
            self.pend_tokens[b], self.pend_feats[b] = [], []
        return self.spec.feed(rows, toks, feats)

    def _cache_rows(self, rows: list[int]) -> torch.Tensor | None:
        dev = self.spec.model_base.device
        return None if rows == list(range(self.spec.cache.batch)) else torch.tensor(rows, device=dev)

    def _tree(self, rows, roots, depths, f, base, max_nodes: int) -> Draft:
        """EAGLE-2 expansion. Level 1 = the root's `width` best children; each further level feeds the
        previous level's `width` best nodes (by cumulative log-probability) through the draft head as
        one chunk that attends to its ancestors, and drafts their `width` best children each."""
        spec, dev = self.spec, self.spec.model_base.device
        n, w = len(rows), self.shape.width
        depth = max(depths)
        sub = self._cache_rows(rows)
        score, tok = spec.top_log_probs(f, w)  # [N, W]
        pool_tok, pool_score, pool_parent = [tok], [score], [torch.full((n, w), -1, device=dev)]
        pool_depth = [1]
        frontier = torch.arange(w, device=dev).expand(n, w)  # [N, W] pool indices of the level's best nodes
        front_feat = f[:, None].expand(n, w, f.shape[-1])  # [N, W, D] predicted feature of each one's parent
        anc = torch.zeros(n, w, 0, dtype=torch.bool)  # [N, W, S] which drafted cache slots each one sees
        eye = torch.eye(w, dtype=torch.bool).expand(n, w, w)
        size = w  # nodes in the pool
        expanded = []  # (pool indices [N, W], their children's tokens [N, W, W]) per level
        for level in range(1, depth):
            all_tok, all_score = torch.cat(pool_tok, 1), torch.cat(pool_score, 1)
            ftok = all_tok.gather(1, frontier)  # [N, W]
            positions = (base[:, None] + level - 1).expand(n, w).to(dev)
            tree = torch.cat((anc, eye), 2)  # [N, W, S + W]
            out = spec.forward(ftok, front_feat, positions, sub, tree=tree)  # [N, W, D] features of the frontier
            child_logp, child_tok = spec.top_log_probs(out, w)  # [N, W, W]
            child_score = child_logp + all_score.gather(1, frontier)[:, :, None]
            pool_tok.append(child_tok.reshape(n, w * w))
            pool_score.append(child_score.reshape(n, w * w))
            pool_parent.append(frontier[:, :, None].expand(n, w, w).reshape(n, w * w))
            pool_depth.append(level + 1)
            expanded.append((frontier, child_tok, child_logp.exp()))
            # the next frontier: the level's best children; they see their parent's ancestors and the parent
            best = child_score.reshape(n, w * w).topk(w, dim=-1).indices  # [N, W] into this level
            parent_slot = best // w  # the frontier node (slot in this chunk) each one descends from
            anc = torch.cat((anc, eye), 2).gather(1, parent_slot.cpu()[:, :, None].expand(n, w, anc.shape[2] + w))
            front_feat = out.gather(1, parent_slot[:, :, None].expand(n, w, out.shape[-1]))
            frontier = size + best
            size += w * w
        depth_of = torch.cat([torch.full((t.shape[1],), d) for t, d in zip(pool_tok, pool_depth)])
        cand = torch.full((n, size, w), -1, dtype=torch.int64, device=dev)  # [N, M, W] children of expanded nodes
        cand_prob = torch.zeros(n, size, w, device=dev)  # [N, M, W] their draft probabilities
        for fr, ct, cp in expanded:
            cand.scatter_(1, fr[:, :, None].expand(n, w, w), ct)
            cand_prob.scatter_(1, fr[:, :, None].expand(n, w, w), cp)
        draft = self._select(roots, depths, torch.cat(pool_tok, 1), torch.cat(pool_score, 1),
                             torch.cat(pool_parent, 1), depth_of.expand(n, -1), cand, cand_prob, max_nodes)
        draft.cand[:, 0], draft.cand_prob[:, 0] = tok.cpu(), score.exp().cpu()  # the root's: level 1
        return draft

    def _select(self, roots, depths, tok, score, parent, depth, cand, cand_prob, max_nodes: int) -> Draft:
        """The max_nodes best pool nodes [N, M] (depth [N, M] below the root; cand [N, M, W] with their
        probabilities cand_prob) as a Draft,
        ordered by depth (parents first). A child's cumulative score never exceeds its parent's; a depth
        penalty breaks ties, so the kept set holds every kept node's ancestors."""
        tok, score, parent, cand, cand_prob = tok.cpu(), score.cpu(), parent.cpu(), cand.cpu(), cand_prob.cpu()
        n, m = tok.shape
        k = min(self.shape.nodes, max_nodes, m)
        keep = (score - 1e-4 * depth).topk(k, dim=-1).indices  # [N, k] pool indices
        order = (depth.gather(1, keep) * m + keep).argsort(-1)
        keep = keep.gather(1, order)  # by depth, then pool order
        draft_idx = torch.full((n, m), -1, dtype=torch.int64)
        draft_idx.scatter_(1, keep, torch.arange(1, k + 1).expand(n, k))
        kp = parent.gather(1, keep)
        node_parent = torch.where(kp >= 0, draft_idx.gather(1, kp.clamp(min=0)), 0)
        allowed = torch.tensor(depths)[:, None]
        tokens = torch.cat((torch.tensor(roots)[:, None], tok.gather(1, keep)), 1)
        parents = torch.cat((torch.full((n, 1), -1), node_parent), 1)
        valid = torch.cat((torch.ones(n, 1, dtype=torch.bool), depth.gather(1, keep) <= allowed), 1)
        parents[~valid] = -1
        node_cand = cand.gather(1, keep[:, :, None].expand(n, k, cand.shape[2]))
        node_prob = cand_prob.gather(1, keep[:, :, None].expand(n, k, cand.shape[2]))
        return Draft(tokens, parents, valid, cand=torch.cat((node_cand[:, :1], node_cand), 1),  # row 0: the caller's
                     cand_prob=torch.cat((node_prob[:, :1], node_prob), 1))

    def _sampled_chain(self, rows, roots, depths, f, base, params, generator) -> Draft:
        spec, dev = self.spec, self.spec.model_base.device
        sub = self._cache_rows(rows)
        drafted, qs = [], []
        for step in range(max(depths)):
            q = probabilities(spec.full_logits(f), params)  # [N, V] the draft's distribution
            tok = torch.multinomial(q, 1, generator=generator).squeeze(1)
            qs.append(q.cpu())
            drafted.append(tok)
            if step + 1 < max(depths):
                f = spec.forward(tok[:, None], f[:, None], (base + step)[:, None].to(dev), sub)[:, 0]
        drafted = torch.stack(drafted, 1).tolist()
        draft = Draft.chains(roots, [d[:k] for d, k in zip(drafted, depths)])
        q = torch.stack(qs, 1)[:, : draft.size - 1]  # [N, T-1, V]
        draft.q = torch.cat((torch.zeros_like(q[:, :1]), q), 1)
        return draft
