"""Speculative decoding (mode="spec"): per step a proposer drafts a continuation of each row, the base
model verifies every drafted token in one forward, and the step commits the longest verified prefix
plus one token from the base model. Greedy output equals dense decoding token for token.

    propose  -> Draft            (proposers: the EAGLE-style draft head, or prompt lookup)
    verify   -> Verdict          (one base forward over the draft with a tree mask; acceptance)
    commit                       (KV of the accepted nodes kept at consecutive slots, positions, tokens)

A draft is a tree whose node 0 is the row's next token (the root: chosen by the last step, not yet
fed); a chain is the tree where node j's parent is j - 1. Node j sits at position prefix + depth(j).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from specee_core.sampling import SamplingParams, probabilities
from specee_core.speculators import ngram_matches
from specee_core.stepper import StepOutput

log = logging.getLogger(__name__)


@dataclass
class Draft:
    tokens: torch.Tensor  # [N, T] node tokens; node 0 = the root
    parent: torch.Tensor  # [N, T] parent node (-1 for the root and for padding); parent[j] < j
    valid: torch.Tensor  # [N, T] bool; rows with fewer nodes are padded
    # [N, T, V] the distribution node j's token was drawn from (row 0 unused); None: deterministic
    # drafts (greedy draft head, prompt lookup), i.e. one-hot on the drafted token
    q: torch.Tensor | None = None

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


class LookupProposer:
    """Prompt lookup (n-gram) drafting, training-free: the tokens that followed the latest earlier
    occurrence of the row's last n tokens (n = max_ngram..1) in its prompt and output."""

    def __init__(self, max_ngram: int = 3):
        self.max_ngram = max_ngram

    def start(self, engine, batch, cache, prefill_hidden: torch.Tensor, lens: torch.Tensor) -> None:
        pass

    def continuation(self, hist: list[int], depth: int) -> list[int]:
        start = next(ngram_matches(hist, self.max_ngram), None)
        return [] if start is None else hist[start : start + depth]

    def propose(self, rows: list[int], batch, depths: list[int],
                params: SamplingParams | None = None, generator: torch.Generator | None = None) -> Draft:
        """Chains after each row's root (its last generated token). Drafts are deterministic (q None)."""
        conts = [self.continuation(batch.prompt_ids[b] + batch.generated[b], d) if d > 0 else []
                 for b, d in zip(rows, depths)]
        return Draft.chains([batch.generated[b][-1] for b in rows], conts)

    def accepted(self, rows: list[int], features: list[torch.Tensor], tokens: list[list[int]]) -> None:
        pass


class DraftHeadProposer:
    """Chains from the EAGLE-style draft head: each step pairs a token with the feature before it
    and predicts the next feature, whose LM-head argmax is the next draft token. The draft's KV cache
    holds only pairs with true base features: entries for drafted tokens are dropped after each step,
    and the next step first feeds the newly committed tokens with their verified features."""

    def __init__(self, speculator):
        self.spec = speculator  # specee_core.speculators.DraftSpeculator (its layer, cache and head)

    def start(self, engine, batch, cache, prefill_hidden: torch.Tensor, lens: torch.Tensor) -> None:
        m = engine.model
        self.spec.start(batch.prompt_ids, m.final_norm(prefill_hidden), lens, cache.max_len)
        n = len(batch.prompt_ids)
        # pending true pairs per row: (token x_{i+1}, feature f_i) from the draft cache's length on
        self.pend_tokens = [[int(t)] for t in batch.next_tokens.tolist()]
        self.pend_feats = [m.final_norm(batch.last_hidden[b : b + 1]) for b in range(n)]  # [1, D] each

    def propose(self, rows: list[int], batch, depths: list[int],
                params: SamplingParams | None = None, generator: torch.Generator | None = None) -> Draft:
        """Greedy drafts when params is None or greedy; otherwise each draft token is sampled from the
        draft's distribution under params, which the draft's q records for rejection sampling."""
        spec, dev = self.spec, self.spec.model_base.device
        sampled = params is not None and not params.greedy
        n, depth = len(rows), max(depths)
        t = max(len(self.pend_tokens[b]) for b in rows)
        toks = torch.zeros(n, t, dtype=torch.int64)
        feats = torch.zeros(n, t, self.pend_feats[rows[0]].shape[-1], dtype=self.pend_feats[rows[0]].dtype)
        counts = torch.tensor([len(self.pend_tokens[b]) for b in rows])
        for r, b in enumerate(rows):
            c = len(self.pend_tokens[b])
            toks[r, :c] = torch.tensor(self.pend_tokens[b])
            feats[r, :c] = self.pend_feats[b]
        idx = torch.tensor(rows)
        cache = spec.cache
        synced = cache.lengths[0, idx].clone()  # [N] host: true pairs already in the draft cache
        sub = idx.to(dev) if n < cache.batch else None
        positions = (synced[:, None] + torch.arange(t)).to(dev)
        n_valid = None if bool((counts == t).all()) else counts
        out = spec._step(toks.to(dev), feats.to(dev), positions, sub, n_valid)  # [N, t, D]
        f = out[torch.arange(n, device=dev), (counts - 1).to(dev)]  # predicted feature after each row's last pair
        drafted, qs = [], []
        for step in range(depth):
            if sampled:
                q = probabilities(self.draft_logits(f), params)  # [N, V]
                tok = torch.multinomial(q, 1, generator=generator).squeeze(1)
                qs.append(q.cpu())
            else:
                tok = spec.top(f, 1)[:, 0]  # [N] the draft's greedy token
            drafted.append(tok)
            if step + 1 < depth:
                pos = (synced + counts + step)[:, None].to(dev)
                f = spec._step(tok[:, None], f[:, None], pos, sub)[:, 0]
        cache.truncate(idx, synced + counts)  # drop the drafted pairs: their features were guesses
        for b in rows:
            self.pend_tokens[b], self.pend_feats[b] = [], None
        drafted = torch.stack(drafted, 1).tolist() if drafted else [[] for _ in rows]
        roots = [batch.generated[b][-1] for b in rows]
        draft = Draft.chains(roots, [d[:k] for d, k in zip(drafted, depths)])
        if sampled and qs:
            q = torch.stack(qs, 1)[:, : draft.size - 1]  # [N, T-1, V]
            draft.q = torch.cat((torch.zeros_like(q[:, :1]), q), 1)
        return draft

    def draft_logits(self, f: torch.Tensor) -> torch.Tensor:
        """Draft output features [N, D] -> logits [N, V] over the whole vocabulary (-inf outside the
        frequent-token subset, when the head ranks one)."""
        spec = self.spec
        if spec.subset is None:
            return spec.model_base.lm_head(f).float()
        out = torch.full((f.shape[0], spec.model_base.config.vocab_size), float("-inf"), device=f.device)
        return out.index_copy_(1, spec.subset, spec.subset_head(f).float())

    def accepted(self, rows: list[int], features: list[torch.Tensor], tokens: list[list[int]]) -> None:
        """features[r] [a + 1, D]: the verified (final-normed) features of row r's root and accepted
        nodes; tokens[r]: the tokens that followed them (the accepted nodes and the bonus token)."""
        for b, f, toks in zip(rows, features, tokens):
            self.pend_tokens[b], self.pend_feats[b] = list(toks), f


@dataclass
class Verdict:
    accepted: list[list[int]]  # per row: accepted node indices after the root, in path order
    tokens: list[list[int]]  # per row: the tokens to commit (accepted nodes' tokens, then the base's next)


def accept_greedy(draft: Draft, base_next: torch.Tensor) -> Verdict:
    """base_next [N, T]: the base model's greedy token after each node. The accepted path is the
    longest one from the root whose every node equals the base's choice after its parent; the
    base's choice after the path's last node is committed after it (the bonus token)."""
    toks, parent, valid = draft.tokens.tolist(), draft.parent.tolist(), draft.valid.tolist()
    nxt = base_next.tolist()
    accepted, out = [], []
    for r in range(len(toks)):
        ok = [True] + [False] * (len(toks[r]) - 1)
        depth = [0] * len(toks[r])
        best = 0
        for j in range(1, len(toks[r])):
            p = parent[r][j]
            if valid[r][j] and p >= 0 and ok[p] and toks[r][j] == nxt[r][p]:
                ok[j], depth[j] = True, depth[p] + 1
                if depth[j] > depth[best]:
                    best = j
        path = []
        j = best
        while j > 0:
            path.append(j)
            j = parent[r][j]
        path.reverse()
        accepted.append(path)
        out.append([toks[r][j] for j in path] + [nxt[r][best]])
    return Verdict(accepted, out)


def accept_sampled(draft: Draft, p: torch.Tensor, generator: torch.Generator | None) -> Verdict:
    """Rejection sampling along chains, which keeps the base model's distribution exactly: p [N, T, V]
    is the base's distribution after each node. Node j's token x (drawn from q_j) is accepted with
    probability min(1, p(x) / q_j(x)); the first rejection draws the committed token from the
    normalised residual max(0, p - q_j) instead; after a fully accepted chain the bonus is drawn from p."""
    toks, valid = draft.tokens.tolist(), draft.valid.tolist()
    accepted, out = [], []
    for r in range(len(toks)):
        path, last, extra = [], 0, None
        for j in range(1, len(toks[r])):
            if not valid[r][j]:
                break
            x = toks[r][j]
            target = p[r, j - 1]
            q = draft.q[r, j] if draft.q is not None else None
            qx = 1.0 if q is None else float(q[x])
            u = float(torch.rand((), generator=generator))
            if qx > 0 and u * qx < float(target[x]):  # u < p(x) / q(x), without dividing
                path.append(j)
                last = j
                continue
            residual = (target - q).clamp_(min=0) if q is not None else target.clone().index_fill_(0, torch.tensor([x]), 0)
            total = float(residual.sum())
            dist = residual / total if total > 0 else target
            extra = int(torch.multinomial(dist, 1, generator=generator))
            break
        if extra is None:
            extra = int(torch.multinomial(p[r, last], 1, generator=generator))
        accepted.append(path)
        out.append([toks[r][j] for j in path] + [extra])
    return Verdict(accepted, out)


@dataclass
class SpecOptions:
    proposer: str = "auto"  # "draft" (the draft head beside the model) | "lookup" | "auto" (draft if present)
    depth: int = 4  # drafted tokens per step (chain length)

    def __post_init__(self) -> None:
        if self.proposer not in ("auto", "draft", "lookup"):
            raise ValueError(f"proposer must be auto, draft or lookup, got {self.proposer!r}")
        if not 1 <= self.depth <= 32:
            raise ValueError(f"depth must be in 1..32, got {self.depth}")


@dataclass
class SpecStats:
    steps: int = 0
    accepted: int = 0  # drafted tokens accepted (bonus tokens not counted)
    t_draft: float = 0.0
    t_verify: float = 0.0
    per_row_steps: list[int] = field(default_factory=list)
    per_row_accepted: list[int] = field(default_factory=list)


class SpecStepper:
    """Decode steps of one batch in mode="spec": propose, verify, commit. Greedy acceptance at
    temperature 0, rejection sampling otherwise (chains)."""

    def __init__(self, proposer, engine, batch, cache, prefill_hidden: torch.Tensor, lens: torch.Tensor,
                 depth: int):
        self.proposer, self.engine, self.batch, self.cache = proposer, engine, batch, cache
        self.model = engine.model
        self.depth = depth
        n = len(batch.prompt_ids)
        self.stats = SpecStats(per_row_steps=[0] * n, per_row_accepted=[0] * n)
        t0 = time.perf_counter()
        proposer.start(engine, batch, cache, prefill_hidden, lens)
        self.stats.t_draft += time.perf_counter() - t0

    def step(self, alive: list[int], rows: torch.Tensor | None, generator) -> tuple[list[list[int]], list[list[int]]]:
        batch, m, dev = self.batch, self.model, self.model.device
        t0 = time.perf_counter()
        # a row drafts no more than it may still emit, minus the bonus token
        depths = [max(0, min(self.depth, batch.max_new[b] - len(batch.generated[b]) - 1)) for b in alive]
        params = batch.params
        draft = self.proposer.propose(alive, batch, depths, params, generator)
        t1 = time.perf_counter()
        depth, anc = draft.depth_and_ancestors()
        start = batch.positions[torch.tensor(alive)].clone()  # [N] host: the root's position = cache length
        positions = (start[:, None] + depth).to(dev)
        h = m.forward(draft.tokens.to(dev), positions, self.cache, rows, tree=anc)
        hn = m.final_norm(h)  # [N, T, D]
        logits = m.lm_head(hn)  # [N, T, V]
        if params.greedy:
            verdict = accept_greedy(draft, logits.max(-1).indices.cpu())
        else:
            verdict = accept_sampled(draft, probabilities(logits, params).cpu(), generator)
        keep = [[0] + path for path in verdict.accepted]
        width = max(len(k) for k in keep)
        nodes = torch.tensor([k + [-1] * (width - len(k)) for k in keep])
        self.cache.keep(rows, start, nodes, torch.tensor([len(k) for k in keep]))
        self.proposer.accepted(alive, [hn[r, torch.tensor(k, device=dev)] for r, k in enumerate(keep)], verdict.tokens)
        last = torch.tensor([k[-1] for k in keep], device=dev)
        hidden = h[torch.arange(len(alive), device=dev), last]  # [N, D] the node whose logits chose the bonus
        t2 = time.perf_counter()
        s = self.stats
        s.steps += 1
        s.t_draft += t1 - t0
        s.t_verify += t2 - t1
        for b, path in zip(alive, verdict.accepted):
            s.per_row_steps[b] += 1
            s.per_row_accepted[b] += len(path)
        L = m.num_layers
        return StepOutput(verdict.tokens, [[L] * len(t) for t in verdict.tokens], hidden)

    def row_stats(self, b: int) -> dict:
        s = self.stats
        total = max(s.t_draft + s.t_verify, 1e-9)
        steps = max(s.per_row_steps[b], 1)
        return {"spec_steps": s.per_row_steps[b], "mean_accepted": s.per_row_accepted[b] / steps,
                "mean_tokens_per_step": (s.per_row_accepted[b] + s.per_row_steps[b]) / steps,
                "draft_time_share": s.t_draft / total, "verify_time_share": s.t_verify / total}
