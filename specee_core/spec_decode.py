"""Speculative decoding (mode="spec"): per step a proposer drafts a continuation of each row, the base
model verifies every drafted token in one forward, and the step commits the longest verified path
plus one token from the base model. Greedy output equals dense decoding token for token; sampled
output keeps the base model's distribution.

    propose  -> Draft     (specee_core.proposers: the EAGLE-style draft head's tree, or prompt lookup)
    verify   -> Verdict   (one base forward over the tree with an ancestor mask; specee_core.acceptance)
    commit   -> StepOutput (KV of the accepted nodes kept at consecutive slots; the engine records tokens)
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from specee_core.acceptance import Verdict, accept_greedy, accept_sampled
from specee_core.proposers import Draft, DraftHeadProposer, LookupProposer, Proposer, TreeShape
from specee_core.sampling import probabilities
from specee_core.stepper import StepOutput

log = logging.getLogger(__name__)

__all__ = ["Draft", "DraftHeadProposer", "LookupProposer", "SpecOptions", "SpecStepper", "Verdict",
           "accept_greedy", "accept_sampled"]


@dataclass
class SpecOptions:
    proposer: str = "auto"  # "draft" (the draft head beside the model) | "lookup" | "auto" (draft if present)
    depth: int = 4  # levels drafted below the root (a chain's length)
    width: int = 1  # draft head: nodes expanded per level and children per expanded node; 1 = a chain
    nodes: int | None = None  # draft head: drafted nodes verified per step; None = depth * width
    lookup: bool = False  # draft head: add the prompt-lookup chain (up to depth more nodes) to its tree

    def __post_init__(self) -> None:
        if self.proposer not in ("auto", "draft", "lookup"):
            raise ValueError(f"proposer must be auto, draft or lookup, got {self.proposer!r}")
        if not 1 <= self.depth <= 32:
            raise ValueError(f"depth must be in 1..32, got {self.depth}")
        if not 1 <= self.width <= 16:
            raise ValueError(f"width must be in 1..16, got {self.width}")
        if self.nodes is None:
            self.nodes = self.depth * self.width
        if not self.depth <= self.nodes <= 128:
            raise ValueError(f"nodes must be in depth..128 ({self.depth}..128), got {self.nodes}")

    @property
    def tree(self) -> TreeShape:
        return TreeShape(depth=self.depth, width=self.width, nodes=self.nodes)


@dataclass
class SpecStats:
    t_draft: float = 0.0
    t_verify: float = 0.0
    t_commit: float = 0.0
    per_row_steps: list[int] = field(default_factory=list)
    per_row_accepted: list[int] = field(default_factory=list)  # drafted tokens accepted (not the bonus)


class SpecStepper:
    """Decode steps of one batch in mode="spec". Greedy acceptance at temperature 0, rejection
    sampling otherwise."""

    def __init__(self, proposer: Proposer, engine, batch, cache, prefill_hidden: torch.Tensor, lens: torch.Tensor,
                 depth: int):
        self.proposer, self.batch, self.cache = proposer, batch, cache
        self.model = engine.model
        self.depth = depth
        n = len(batch.prompt_ids)
        self.stats = SpecStats(per_row_steps=[0] * n, per_row_accepted=[0] * n)
        t0 = time.perf_counter()
        proposer.start(engine, batch, cache, prefill_hidden, lens)
        self.stats.t_draft += time.perf_counter() - t0

    def step(self, alive: list[int], rows: torch.Tensor | None, generator) -> StepOutput:
        t0 = time.perf_counter()
        draft = self.propose(alive, generator)
        t1 = time.perf_counter()
        start = self.batch.positions[torch.tensor(alive)].clone()  # [N] host: the root's position = cache length
        h, hn, verdict = self.verify(draft, start, rows, generator)
        t2 = time.perf_counter()
        out = self.commit(alive, rows, start, h, hn, verdict)
        s = self.stats
        s.t_draft += t1 - t0
        s.t_verify += t2 - t1
        s.t_commit += time.perf_counter() - t2
        return out

    def propose(self, alive: list[int], generator) -> Draft:
        batch = self.batch
        # a row drafts no deeper than it may still emit, minus the bonus token
        depths = [max(0, min(self.depth, batch.max_new[b] - len(batch.generated[b]) - 1)) for b in alive]
        return self.proposer.propose(alive, batch, depths, batch.params, generator)

    def verify(self, draft: Draft, start: torch.Tensor, rows: torch.Tensor | None,
               generator) -> tuple[torch.Tensor, torch.Tensor, Verdict]:
        """One forward of the base model over every node (node j at position start + depth(j), seeing
        its ancestors); returns hidden [N, T, D], its final norm, and what each row accepts."""
        m, params = self.model, self.batch.params
        depth, anc = draft.depth_and_ancestors()
        positions = (start[:, None] + depth).to(m.device)
        h = m.forward(draft.tokens.to(m.device), positions, self.cache, rows, tree=anc)  # [N, T, D]
        hn = m.final_norm(h)
        logits = m.lm_head(hn)  # [N, T, V]
        if params.greedy:
            return h, hn, accept_greedy(draft, logits.max(-1).indices.cpu())
        return h, hn, accept_sampled(draft, probabilities(logits, params).cpu(), generator)

    def commit(self, alive: list[int], rows: torch.Tensor | None, start: torch.Tensor, h: torch.Tensor,
               hn: torch.Tensor, verdict: Verdict) -> StepOutput:
        """Keep the accepted nodes' KV at consecutive slots after each row's prefix, hand the proposer
        their verified features, and return the tokens (the engine stops a row inside its block)."""
        dev = self.model.device
        keep = [[0] + path for path in verdict.accepted]  # the root and the accepted nodes
        width = max(len(k) for k in keep)
        nodes = torch.tensor([k + [-1] * (width - len(k)) for k in keep])  # [N, A]
        self.cache.keep(rows, start, nodes, torch.tensor([len(k) for k in keep]))
        self.proposer.accepted(alive, [hn[r, torch.tensor(k, device=dev)] for r, k in enumerate(keep)], verdict.tokens)
        last = torch.tensor([k[-1] for k in keep], device=dev)
        hidden = h[torch.arange(len(alive), device=dev), last]  # [N, D] the node whose logits chose the bonus
        s = self.stats
        for b, path in zip(alive, verdict.accepted):
            s.per_row_steps[b] += 1
            s.per_row_accepted[b] += len(path)
        layers = self.model.num_layers
        return StepOutput(verdict.tokens, [[layers] * len(t) for t in verdict.tokens], hidden)

    def row_stats(self, b: int) -> dict:
        s = self.stats
        total = max(s.t_draft + s.t_verify + s.t_commit, 1e-9)
        steps = max(s.per_row_steps[b], 1)
        return {"spec_steps": s.per_row_steps[b], "mean_accepted": s.per_row_accepted[b] / steps,
                "mean_tokens_per_step": (s.per_row_accepted[b] + s.per_row_steps[b]) / steps,
                "draft_time_share": s.t_draft / total, "verify_time_share": s.t_verify / total,
                "commit_time_share": s.t_commit / total}
