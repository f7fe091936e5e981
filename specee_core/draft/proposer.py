"""The proposer: what every mode that guesses ahead drafts from, one per lane of the engine core.

Two sources, each kept once:
- the draft head (DraftModel), with the lane's draft KV cache and one queue per row of the true
  (token, feature) pairs it has not been fed yet: a step that drafts nothing (a dense step, a row that
  took prompt lookup's chain) leaves its pairs queued, and the next draft feeds them in one chunk first;
- prompt lookup, one n-gram index over the rows' token lists (Batch.tokens, the one copy of them).

SpecEE's decode steps ask for k candidates of each row's next token (`candidates`) and prompt lookup's
followers (`followers`, the calibration's veto); speculative steps for a tree (`tree`) or lookup chains
(`continuation`). The draft cache holds only pairs with true base features: what a tree drafts is cut
again before the step ends (the proposer alone truncates its cache).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from specee_core.draft.lookup import LOOKUP_NGRAM, NgramIndex
from specee_core.draft.tree import Draft, TreeShape
from specee_core.step.grammar import allowed_tokens, refusing

if TYPE_CHECKING:
    from specee_core.draft.head import DraftModel
    from specee_core.step.state import Batch

SOURCES = ("draft", "lookup")  # where SpecEE's candidates come from
FEED_APART = 16  # queued pairs over which a row is fed apart from rows with fewer (see Proposer._feed)


class Proposer:
    """Drafts for the rows of one lane (`rows` rows, KV of up to max_len positions). draft: the draft head
    (None: prompt lookup alone)."""

    def __init__(self, draft: DraftModel | None, rows: int, max_len: int, device: torch.device,
                 ngram: int = LOOKUP_NGRAM):
        self.draft, self.device = draft, device
        self.cache = None if draft is None else draft.new_cache(rows, max_len)
        self.queue_tokens: list[list[int]] = [[] for _ in range(rows)]  # per row: pairs' tokens not fed yet
        self.queue_feats: list[list[torch.Tensor]] = [[] for _ in range(rows)]  # ... their features, [c, D] each
        self.index = NgramIndex(ngram)
        self.catch_up_s = 0.0  # seconds spent feeding long backlogs (take_catch_up) ...
        self.catch_up_pairs = 0  # ... and the pairs fed then

    def caches(self) -> list:
        """The KV caches it keeps (the draft head's), which grow with the target's."""
        return [] if self.cache is None else [self.cache]

    # ---- rows ------------------------------------------------------------------------------------
    def admit(self, batch: Batch, rows: list[int], prefill_hidden: torch.Tensor, lens: torch.Tensor) -> None:
        """Rows start (or resume) prompts, prefilled: prefill_hidden [N, T, D] (before the final norm) of each
        row's context, lens [N]. The context's pairs but the last are queued for the draft cache, fed with the
        first draft that needs them (a batch whose plan never drafts never runs the head over its prompts); its
        stepper pushes the last with the token it feeds (push, push_last)."""
        for b in rows:
            self.index.reset(b)
            self.queue_tokens[b], self.queue_feats[b] = [], []
        if self.draft is None:
            return
        self.cache.truncate(torch.tensor(rows), torch.zeros(len(rows), dtype=torch.int64))
        if prefill_hidden.shape[1] < 2:
            return
        feats = self.draft.base.final_norm(prefill_hidden[:, :-1])
        for r, b in enumerate(rows):
            c = int(lens[r]) - 1  # pairs (x_{i+1}, f_i) for i < len - 1, at draft positions 0 .. c - 1
            if c > 0:
                self.queue_tokens[b] = list(batch.context(b)[1 : c + 1])
                self.queue_feats[b] = [feats[r, :c].clone()]

    def push(self, rows: list[int], tokens: list[list[int]], features: list[torch.Tensor]) -> None:
        """After a step, each row's true pairs: features[r] [c, D] (final-normed) of its fed positions and
        tokens[r], the c tokens that followed them. Queued until the next draft."""
        if self.draft is None:
            return
        for b, toks, f in zip(rows, tokens, features):
            self.queue_tokens[b] += toks
            self.queue_feats[b].append(f)

    def push_last(self, batch: Batch, rows: list[int]) -> None:
        """Queue each row's pair (its last token, the feature it was chosen from: Batch.last_hidden): what a
        row admitted now feeds first."""
        if self.draft is not None:
            last = self.draft.base.final_norm(batch.last_hidden[torch.tensor(rows, device=self.device)])  # [N, D]
            self.push(rows, [[batch.last(b)] for b in rows], list(last.split(1)))

    def _feed(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Feeds each row's queued pairs (at least one) in one chunk after what its draft cache holds.
        Returns (synced [N]: the cache lengths before, counts [N]: the pairs fed, f [N, D]: the predicted
        feature after each row's last pair, whose LM-head ranks its next token); lengths on the host. Rows with
        a long backlog (a prompt, a long dense stretch) beside rows with a few pairs are fed apart: one chunk
        would pad every row to the longest."""
        counts = [len(self.queue_tokens[b]) for b in rows]
        long = [r for r, c in enumerate(counts) if c > FEED_APART]
        if long and len(long) < len(rows):
            short = [r for r, c in enumerate(counts) if c <= FEED_APART]
            parts = [self._feed_chunk([rows[r] for r in short]), self._timed_catch_up([rows[r] for r in long])]
            order = torch.tensor(short + long).argsort()  # back to rows' order
            synced, fed, f = (torch.cat([part[i] for part in parts]) for i in range(3))
            return synced[order], fed[order], f[order.to(f.device)]
        return self._timed_catch_up(rows) if long else self._feed_chunk(rows)

    def _timed_catch_up(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """_feed_chunk for rows with a long backlog, its time added to catch_up_s: what a drafted step spent
        catching the draft head up (a prompt, a dense stretch) is not what drafting costs a step."""
        pairs = self.backlog(rows)
        t0 = time.perf_counter()
        out = self._feed_chunk(rows)
        self.catch_up_s += time.perf_counter() - t0
        self.catch_up_pairs += pairs
        return out

    def take_catch_up(self) -> tuple[float, int]:
        """Seconds spent catching up since the last call, and the pairs fed then (and reset)."""
        out = (self.catch_up_s, self.catch_up_pairs)
        self.catch_up_s, self.catch_up_pairs = 0.0, 0
        return out

    def backlog(self, rows: list[int]) -> int:
        """The pairs these rows have queued for the draft head: what it feeds before it can draft for them."""
        return sum(len(self.queue_tokens[b]) for b in rows) if self.draft is not None else 0

    def _feed_chunk(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """_feed for rows fed together in one chunk."""
        dev, n = self.device, len(rows)
        toks = [self.queue_tokens[b] for b in rows]
        feats = [self.queue_feats[b] for b in rows]
        for b in rows:
            self.queue_tokens[b], self.queue_feats[b] = [], []
        counts = torch.tensor([len(x) for x in toks])
        t = int(counts.max())
        if t == 1:  # one pair per row (every SpecEE step): no padding
            tok = torch.tensor(toks)
            feat = torch.cat([f[0] for f in feats])[:, None]
        else:
            tok = torch.zeros(n, t, dtype=torch.int64)
            feat = torch.zeros(n, t, feats[0][0].shape[-1], dtype=feats[0][0].dtype, device=dev)
            for r, (x, f) in enumerate(zip(toks, feats)):
                tok[r, : len(x)] = torch.tensor(x)
                feat[r, : len(x)] = torch.cat(f)
        synced = self.cache.lengths[0, torch.tensor(rows)].clone()
        positions = (synced[:, None] + torch.arange(t)).to(dev)
        sub = None if rows == list(range(self.cache.batch)) else torch.tensor(rows, device=dev)
        n_valid = None if bool((counts == t).all()) else counts
        out = self.draft.forward(self.cache, tok.to(dev), feat, positions, sub, n_valid)  # [N, t, D]
        return synced, counts, out[torch.arange(n, device=dev), (counts - 1).to(dev)]

    # ---- SpecEE: candidates of the next token ----------------------------------------------------
    def candidates(self, rows: list[int], batch: Batch, k: int, source: str
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """k candidates [N, K] of each row's next token (the one after the token it feeds now) and the
        draft's probabilities of them [N, K] fp32 (None for prompt lookup's). source "draft": the draft
        head's k most likely; "lookup": prompt lookup's, completed from the draft head's (when there is
        one), then the row's most frequent tokens."""
        if source == "draft":
            logp, ids = self.draft.top_log_probs(self._feed(rows)[2], k)
            return ids, logp.exp()
        extra = None if self.draft is None else self.draft.top_log_probs(self._feed(rows)[2], k)[1].tolist()
        out = []
        for r, b in enumerate(rows):
            hist = batch.tokens[b]
            c = self.index.candidates(b, hist, k)
            pool = (extra[r] if extra else []) + self.index.frequent(b, hist, 2 * k)
            pool += list(range(2 * k))  # a row too short to fill k: any distinct ids
            for tok in pool:
                if len(c) == k:
                    break
                if tok not in c:
                    c.append(tok)
            out.append(c)
        return torch.tensor(out, dtype=torch.int64, device=self.device), None

    def followers(self, rows: list[int], batch: Batch) -> torch.Tensor:
        """[N, ngram] per row: NgramIndex.followers of its tokens (the lookup veto's evidence)."""
        return torch.tensor([self.index.followers(b, batch.tokens[b]) for b in rows])

    # ---- speculative decoding: drafts to verify --------------------------------------------------
    def continuation(self, b: int, batch: Batch, depth: int) -> list[int]:
        """Prompt lookup's chain after row b's last token, up to depth tokens ([] when nothing matches); under
        structured output cut before the first token the row's grammar refuses (verification would reject it
        and every token after it)."""
        chain = self.index.continuation(b, batch.tokens[b], depth) if depth > 0 else []
        matcher = batch.matchers[b] if chain else None
        return chain if matcher is None else chain[: matcher.validate_tokens(chain)]

    def forced(self, b: int, batch: Batch, depth: int, path: list[int] | None = None) -> list[int]:
        """Up to depth tokens row b's structured output forces after its last token (and path): a chain that
        needs no draft forward ([] without a grammar, or where the grammar leaves a choice)."""
        matcher = batch.matchers[b]
        return [] if matcher is None else batch.grammars[b].forced(matcher, path or [], depth)

    def tree(self, rows: list[int], batch: Batch, depths: list[int], shape: TreeShape,
             max_nodes: int | None = None) -> Draft:
        """The draft head's draft after each row's root, no deeper than depths[r] and with at most max_nodes
        drafted nodes (None: shape.nodes): a tree of its most likely tokens, or, with width 1 where some row
        samples, a chain each row chooses from the draft's distribution as it chooses from the target's
        (Batch.choose: greedy rows its argmax, sampled rows their draw at their own uniform of each index, which
        the target's choice there shares). With structured output a chain's every level is drafted among the
        tokens the row's grammar allows there."""
        roots = [batch.last(b) for b in rows]
        matchers = [batch.matchers[b] for b in rows] if batch.constrained(rows) else None
        synced, counts, f = self._feed(rows)
        if max(depths) == 0:  # every row is one token from its end: the base's token alone
            return Draft.chains(roots, [[] for _ in rows])
        base = synced + counts  # [N] host: the draft cache slot of the first drafted node
        try:
            if shape.width == 1 and not batch.greedy(rows):
                return self._chosen_chain(rows, batch, roots, depths, f, base, matchers)
            return self._expand(rows, roots, depths, f, base, shape, max_nodes or shape.nodes,
                                matchers if shape.width == 1 else None, batch)
        finally:
            self.cache.truncate(torch.tensor(rows), base)  # drop the drafted pairs: their features were guesses

    def _cache_rows(self, rows: list[int]) -> torch.Tensor | None:
        return None if rows == list(range(self.cache.batch)) else torch.tensor(rows, device=self.device)

    def _expand(self, rows, roots, depths, f, base, shape: TreeShape, max_nodes: int, matchers=None,
                batch: Batch | None = None) -> Draft:
        """EAGLE-2 expansion. Level 1 = the root's `width` best children; each further level feeds the
        previous level's `width` best nodes (by cumulative log-probability) through the draft head as
        one chunk that attends to its ancestors, and drafts their `width` best children each. matchers
        (chains only): each level drafts among what the row's grammar allows after the chain so far."""
        draft, dev = self.draft, self.device
        n, w = len(rows), shape.width
        depth = max(depths)
        sub = self._cache_rows(rows)
        chain: list[list[int]] = [[] for _ in rows]  # matchers: the drafted chain so far
        memo = None if batch is None else batch.mask_memo
        score, tok = self._top(f, w, matchers, chain, [(b, ()) for b in rows], memo)  # [N, W]
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
            out = draft.forward(self.cache, ftok, front_feat, positions, sub, tree=tree)  # [N, W, D] the frontier's
            if matchers is not None:  # width 1: the frontier is the chain's last token
                for r, t in enumerate(ftok[:, 0].tolist()):
                    chain[r].append(t)
            child_logp, child_tok = self._top(out, w, matchers, chain,
                                              [(b, tuple(c)) for b, c in zip(rows, chain)], memo)  # [N, W, W]
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
        out = _select(roots, depths, torch.cat(pool_tok, 1), torch.cat(pool_score, 1), torch.cat(pool_parent, 1),
                      depth_of.expand(n, -1), cand, cand_prob, min(shape.nodes, max_nodes))
        out.cand[:, 0], out.cand_prob[:, 0] = tok.cpu(), score.exp().cpu()  # the root's: level 1
        return out

    def _top(self, feats: torch.Tensor, w: int, matchers, chain: list[list[int]], keys: list, memo):
        """The draft head's top_log_probs (feats [N, D] or [N, 1, D]); with matchers (chains: w 1), the best
        token each row's grammar allows after its chain: the head's best where the grammar allows it (one
        check), else the best under the row's mask (a pass over the vocabulary)."""
        score, tok = self.draft.top_log_probs(feats, w)
        if matchers is None:
            return score, tok
        masked = refusing(matchers, chain, tok.reshape(len(chain), -1)[:, 0].tolist())
        if all(m is None for m in masked):
            return score, tok
        allowed = allowed_tokens(masked, chain, self.draft.base.config.vocab_size, keys, memo)
        return self.draft.top_log_probs(feats, w, allowed if feats.dim() == 2 else allowed[:, None])

    def _chosen_chain(self, rows, batch: Batch, roots, depths, f, base, matchers=None) -> Draft:
        """Chains of depths[r] tokens, each level chosen by each row from the draft head's distribution
        (Batch.choose at the index the token would take)."""
        draft, dev = self.draft, self.device
        sub = self._cache_rows(rows)
        drafted = []
        vocab = draft.base.config.vocab_size
        first = [len(batch.tokens[b]) for b in rows]  # where the first drafted token would stand
        for step in range(max(depths)):
            allowed = None
            if matchers is not None:  # the grammar's tokens after the chain so far
                allowed = allowed_tokens(matchers, torch.stack(drafted, 1).tolist() if drafted else [[] for _ in rows],
                                         vocab)
            tok = batch.choose(draft.full_logits(f, allowed), rows, [i + step for i in first])
            drafted.append(tok)
            if step + 1 < max(depths):
                f = draft.forward(self.cache, tok[:, None], f[:, None], (base + step)[:, None].to(dev), sub)[:, 0]
        drafted = torch.stack(drafted, 1).tolist()
        return Draft.chains(roots, [d[:k] for d, k in zip(drafted, depths)])


def _select(roots, depths, tok, score, parent, depth, cand, cand_prob, max_nodes: int) -> Draft:
    """The max_nodes best pool nodes [N, M] (depth [N, M] below the root; cand [N, M, W] with their
    probabilities cand_prob) as a Draft, ordered by depth (parents first). A child's cumulative score never
    exceeds its parent's; a depth penalty breaks ties, so the kept set holds every kept node's ancestors."""
    tok, score, parent, cand, cand_prob = tok.cpu(), score.cpu(), parent.cpu(), cand.cpu(), cand_prob.cpu()
    n, m = tok.shape
    k = min(max_nodes, m)
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
