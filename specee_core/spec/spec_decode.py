"""Speculative decoding (mode="spec", and mode="auto" through a planner): per step a proposer drafts a
continuation of each row, the base model verifies every drafted token in one forward, and the step
commits the longest verified path plus one token from the base model. Each row's committed tokens are the
ones dense decoding chooses (greedy: the argmax; sampled: the draw at the row's own uniform for that token,
specee_core.step.sampling), token for token (fp32), so sampled output keeps the base model's distribution
exactly and a seeded row's text does not depend on how its steps were drafted. In mode="auto"
a Planner (specee_core.spec.plan) sizes each step from measured costs, down to a plain dense step.

    propose  -> Draft     (specee_core.draft.proposer: the EAGLE-style draft head's tree, prompt lookup's chains)
    verify   -> Verdict   (one base forward over the tree with an ancestor mask; specee_core.spec.acceptance)
    commit   -> StepOutput (KV of the accepted nodes kept at consecutive slots; the engine records tokens)
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from specee_core.spec.acceptance import Verdict, accept_greedy
from specee_core.spec.plan import Planner, StepPlan
from specee_core.draft.proposer import Proposer
from specee_core.draft.tree import Draft, TreeShape
from specee_core.step.dense import dense_step
from specee_core.step.stepper import StepOutput
from specee_core.spec.t3 import T3, Verified, verify_with_exits

log = logging.getLogger(__name__)

__all__ = ["Draft", "SpecOptions", "SpecStepper", "Verdict", "accept_greedy"]


@dataclass
class SpecOptions:
    proposer: str = "auto"  # "draft" (the draft head beside the model) | "lookup" | "auto" (draft if present)
    depth: int = 4  # levels drafted below the root (a chain's length)
    width: int = 1  # draft head: nodes expanded per level and children per expanded node; 1 = a chain
    nodes: int | None = None  # draft head: drafted nodes verified per step; None = depth * width
    # draft head with prompt lookup: "off"; "merge": the lookup chain (up to depth more nodes) joins the
    # draft's tree; "first": a row whose lookup finds a continuation verifies that chain alone (no draft
    # forward that step), the others the draft's tree. "first" by measurement (docs/bench_smollm2_spec.json:
    # faster than the draft's chain alone or lookup alone)
    lookup: str = "first"
    t3: bool = False  # SpecEE T3: exit predictors may end the verify forward early (lossy; steps whose rows are all greedy)
    # nodes a fixed-shape step verifies across the batch, roots included: each row drafts at most
    # budget // rows - 1. None: no limit. mode="auto" ignores it: its planner sizes every step from
    # measured costs (specee_core.spec.plan)
    step_budget: int | None = None

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
        if self.lookup not in ("off", "merge", "first"):
            raise ValueError(f"lookup must be off, merge or first, got {self.lookup!r}")
        if self.step_budget is not None and not (isinstance(self.step_budget, int) and self.step_budget >= 1):
            raise ValueError(f"step_budget must be an int >= 1 or None, got {self.step_budget!r}")

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
    per_row_forced: list[int] = field(default_factory=list)  # tokens drafted because a grammar forced them


class SpecStepper:
    """Decode steps of one batch in mode="spec" (a fixed shape) or "auto" (planned). A drafted token is accepted
    where it is the token its row chooses there (Batch.choose: greedy or its own draw)."""

    def __init__(self, draft, opts: SpecOptions, engine, batch, cache, prefill_hidden: torch.Tensor,
                 lens: torch.Tensor, t3: T3 | None = None, planner: Planner | None = None):
        """draft: the engine's DraftModel (None: prompt lookup drafts alone); opts: the draft's shape (depth
        is the deepest chain), how prompt lookup joins the draft head (opts.lookup) and the step budget.
        planner: size each step from measured costs and acceptance (mode="auto": per row lookup's chain or
        the draft head's); without one every step drafts the fixed shape."""
        self.batch, self.cache, self.model = batch, cache, engine.model
        self.proposer = Proposer(draft, batch.size, cache.max_len, self.model.device)
        self.opts, self.shape, self.depth = opts, opts.tree, opts.depth
        self.t3, self.step_budget, self.planner = t3, opts.step_budget, planner
        n = batch.size
        self.stats = SpecStats(per_row_steps=[0] * n, per_row_accepted=[0] * n, per_row_forced=[0] * n)

    def caches(self) -> list:
        return self.proposer.caches()

    def admit(self, rows: list[int], prefill_hidden: torch.Tensor, lens: torch.Tensor) -> None:
        for b in rows:
            self.stats.per_row_steps[b] = self.stats.per_row_accepted[b] = self.stats.per_row_forced[b] = 0
        t0 = time.perf_counter()
        self.proposer.admit(self.batch, rows, prefill_hidden, lens)
        self.proposer.push_last(self.batch, rows)
        self.stats.t_draft += time.perf_counter() - t0
        if self.planner is not None:
            self.planner.admit(rows)

    def step(self, alive: list[int], rows: torch.Tensor | None) -> StepOutput:
        if self.planner is not None:
            return self._planned_step(alive, rows)
        t0 = time.perf_counter()
        draft = self.propose(alive)
        t1 = time.perf_counter()
        if draft.size == 1:  # nothing drafted (the step budget): a dense step
            return self._dense_step(alive, rows, t1 - t0)
        return self._verify_step(alive, rows, draft, t1 - t0)

    def _verify_step(self, alive: list[int], rows: torch.Tensor | None, draft: Draft, t_draft: float) -> StepOutput:
        t1 = time.perf_counter()
        start = self.batch.positions[torch.tensor(alive)].clone()  # [N] host: the root's position = cache length
        v = self.verify(alive, draft, start, rows)
        t2 = time.perf_counter()
        out = self.commit(alive, rows, start, v)
        s = self.stats
        s.t_draft += t_draft
        s.t_verify += t2 - t1
        s.t_commit += time.perf_counter() - t2
        return out

    def _planned_step(self, alive: list[int], rows: torch.Tensor | None) -> StepOutput:
        """mode="auto": the planner picks dense or a chain depth, and per row lookup's chain or the draft
        head's, from measured costs and the acceptance seen so far; the step's outcome updates it."""
        t0 = time.perf_counter()
        batch = self.batch
        left, backlog = [batch.room(b) for b in alive], self.proposer.backlog(alive)  # what a switch could earn, costs
        plan = self.planner.dense_ahead(alive, left, backlog)
        if plan is not None:  # dense whatever the table says: no lookups, no plan; the rows' estimates drift back
            out = self._dense_step(alive, rows, 0.0)
            self.planner.timed(plan, time.perf_counter() - t0, len(alive))
            self.planner.observe(alive, plan, [0] * len(alive), [None] * len(alive))
            return out
        use_lookup = self.opts.lookup != "off"
        conts = [self.proposer.continuation(b, batch, self.depth) if use_lookup else [] for b in alive]
        rooms = [max(0, min(self.depth, room - 1)) for room in left]
        # structured output: the tokens a row's grammar forces next, drafted with no draft forward
        constrained = batch.constrained(alive)
        forced = ([self.proposer.forced(b, batch, room) if room else [] for b, room in zip(alive, rooms)]
                  if constrained else [[] for _ in alive])  # nothing to ask a row without a grammar
        plan = self.planner.choose(alive, [len(c) for c in conts], rooms, [len(f) for f in forced], left, backlog)
        if plan.depth == 0:
            out = self._dense_step(alive, rows, time.perf_counter() - t0)
            accepted = [0] * len(alive)
        else:
            draft = self._planned_draft(alive, plan, conts, forced)
            if constrained:
                draft = self._with_forced_tails(alive, draft)
            out = self._verify_step(alive, rows, draft, time.perf_counter() - t0)
            accepted = [len(t) - 1 for t in out.tokens]
        # the step's time without catching the draft head up on a long backlog (the first draft after a prompt
        # or a dense stretch): the planner weighs what drafting costs a step; a try is also charged that once
        catch_up, pairs = self.proposer.take_catch_up()
        self.planner.timed(plan, time.perf_counter() - t0 - catch_up, sum(map(len, out.tokens)), catch_up, pairs)
        shadow = [None if not c or k == "lookup" else int(c[0] == t[0]) for c, k, t in zip(conts, plan.kinds, out.tokens)]
        self.planner.observe(alive, plan, accepted, shadow)
        return out

    def _planned_draft(self, alive: list[int], plan: StepPlan, conts: list[list[int]], forced: list[list[int]]
                       ) -> Draft:
        """The plan's draft: lookup rows verify their lookup chain, forced rows their grammar's forced tokens,
        draft rows the proposer's chain, the others their root alone."""
        batch = self.batch
        drafted = [r for r, k in enumerate(plan.kinds) if k == "draft"]
        if len(drafted) == len(alive):
            return self.proposer.tree(alive, batch, list(plan.depths), self.shape)
        roots = [batch.last(b) for b in alive]
        given = {"lookup": conts, "forced": forced}
        for r, k in enumerate(plan.kinds):
            if k == "forced":
                self.stats.per_row_forced[alive[r]] += plan.depths[r]
        chains = [given[k][r][: plan.depths[r]] if k in given else [] for r, k in enumerate(plan.kinds)]
        if not drafted:
            return Draft.chains(roots, chains)
        rest = sorted(set(range(len(alive))) - set(drafted))
        tree = self.proposer.tree([alive[r] for r in drafted], batch, [plan.depths[r] for r in drafted], self.shape)
        return Draft.by_rows(len(alive), [(rest, Draft.chains([roots[r] for r in rest], [chains[r] for r in rest])),
                                          (drafted, tree)])

    def _with_forced_tails(self, alive: list[int], draft: Draft) -> Draft:
        """The draft with each row's deepest path extended by what its grammar forces after it (a drafted
        closing quote, then the next key): verified in the same forward, at no draft cost."""
        toks, parent, valid = draft.tokens.tolist(), draft.parent.tolist(), draft.valid.tolist()
        tails, longer = [], False
        for r, b in enumerate(alive):
            node = max(j for j in range(len(toks[r])) if valid[r][j])  # nodes are ordered by depth
            path = []
            while node > 0:
                path.append(toks[r][node])
                node = parent[r][node]
            path.reverse()
            room = min(self.depth, self.batch.room(b) - 1) - len(path)
            tail = self.proposer.forced(b, self.batch, room, path) if path else []
            tails.append(path + tail)
            longer |= bool(tail)
            self.stats.per_row_forced[b] += len(tail)
        return draft.with_chains(tails) if longer else draft

    def _dense_step(self, alive: list[int], rows: torch.Tensor | None, t_draft: float) -> StepOutput:
        """The roots alone through every layer, as dense decoding does (no tree mask, no KV compaction);
        the proposer still learns the verified features."""
        t0 = time.perf_counter()
        out = dense_step(self.model, self.batch, self.cache, alive, rows)
        self.proposer.push(alive, out.tokens, list(self.model.final_norm(out.hidden).split(1)))  # features [1, D]
        for b in alive:
            self.stats.per_row_steps[b] += 1
        self.stats.t_draft += t_draft
        self.stats.t_verify += time.perf_counter() - t0
        return out

    def propose(self, alive: list[int]) -> Draft:
        """Each row's draft: no deeper than it may still emit (minus the bonus token), no more nodes than
        the step budget leaves it; with nothing to draft, the root alone (a dense step). Prompt lookup alone
        drafts chains; with the draft head, opts.lookup says how lookup's chain joins its tree."""
        batch, p, mode = self.batch, self.proposer, self.opts.lookup
        allowance = self.depth if self.step_budget is None else self.step_budget // len(alive) - 1
        depths = [max(0, min(self.depth, allowance, batch.room(b) - 1)) for b in alive]
        roots = [batch.last(b) for b in alive]
        if max(depths) == 0:
            return Draft.chains(roots, [[] for _ in alive])
        if p.draft is None:
            return Draft.chains(roots, [p.continuation(b, batch, d) for b, d in zip(alive, depths)])
        max_nodes = None if self.step_budget is None else allowance
        if mode == "first":  # a row whose lookup finds a chain verifies it alone
            conts = [p.continuation(b, batch, d) for b, d in zip(alive, depths)]
            found = [r for r, c in enumerate(conts) if c]
            rest = [r for r, c in enumerate(conts) if not c]
            if found:
                chains = Draft.chains([roots[r] for r in found], [conts[r] for r in found])
                if not rest:
                    return chains
                tree = p.tree([alive[r] for r in rest], batch, [depths[r] for r in rest], self.shape, max_nodes)
                return Draft.by_rows(len(alive), [(found, chains), (rest, tree)])
        tree = p.tree(alive, batch, depths, self.shape, max_nodes)
        if mode == "merge":  # lookup's chain joins the tree
            tree = tree.with_chains([p.continuation(b, batch, d) for b, d in zip(alive, depths)])
        if batch.constrained(alive) and self.shape.width == 1 and self.step_budget is None:
            tree = self._with_forced_tails(alive, tree)  # a chain's tail stays within depth (a tree's nodes would not)
        return tree

    def verify(self, alive: list[int], draft: Draft, start: torch.Tensor, rows: torch.Tensor | None) -> Verified:
        """One forward of the base model over every node (node j at position start + depth(j), seeing
        its ancestors) and what each row accepts: the path whose every token is the one its row chooses after
        the node before (Batch.choose, from the logits as the row's params process them over its output and
        the drafted tokens on the path; a sampled row draws at its uniform for that token's index). With T3 (and
        every row greedy) the forward may stop at a scheduled layer."""
        m, batch = self.model, self.batch
        depth, anc = draft.depth_and_ancestors()
        positions = (start[:, None] + depth).to(m.device)
        greedy = batch.greedy(alive)
        if self.t3 is not None and greedy and draft.cand is not None:
            return verify_with_exits(m, self.cache, draft, positions, anc, rows, self.t3)
        h = m.forward(draft.tokens.to(m.device), positions, self.cache, rows, tree=anc)  # [N, T, D]
        hn = m.final_norm(h)
        logits = m.lm_head(hn)  # [N, T, V]
        n, t = draft.tokens.shape
        flat_rows = [b for b in alive for _ in range(t)]
        flat = logits.reshape(n * t, -1)
        if any(batch.sampling[b].processes for b in alive):
            toks, on_path = draft.tokens.tolist(), anc.tolist()
            paths = [[toks[r][i] for i in range(1, t) if on_path[r][j][i]] for r in range(n) for j in range(t)]
            flat = batch.processed(flat, flat_rows, paths)
        if greedy:
            choice = flat.max(-1).indices
        else:  # the token after node j stands at index start + 1 + depth(j) of its row
            choice = batch.choose(flat, flat_rows, (start[:, None] + 1 + depth).flatten().tolist())
        return Verified(h, hn, accept_greedy(draft, choice.reshape(n, t).cpu()), m.num_layers)

    def commit(self, alive: list[int], rows: torch.Tensor | None, start: torch.Tensor, v: Verified) -> StepOutput:
        """Keep the accepted nodes' KV at consecutive slots after each row's prefix (after a T3 exit, the
        skipped layers' KV from the exit hidden state), hand the proposer their verified features, and
        return the tokens (the engine stops a row inside its block)."""
        m, dev = self.model, self.model.device
        keep = [[0] + path for path in v.verdict.accepted]  # the root and the accepted nodes
        width = max(len(k) for k in keep)
        nodes = torch.tensor([k + [-1] * (width - len(k)) for k in keep])  # [N, A]
        counts = torch.tensor([len(k) for k in keep])
        self.cache.keep(rows, start, nodes, counts)
        if v.layers < m.num_layers:
            self._fill_skipped_layers(rows, start, nodes, counts, v)
        self.proposer.push(alive, v.verdict.tokens, [v.hn[r, torch.tensor(k, device=dev)] for r, k in enumerate(keep)])
        last = torch.tensor([k[-1] for k in keep], device=dev)
        hidden = v.h[torch.arange(len(alive), device=dev), last]  # [N, D] the node whose logits chose the bonus
        s = self.stats
        for b, path in zip(alive, v.verdict.accepted):
            s.per_row_steps[b] += 1
            s.per_row_accepted[b] += len(path)
        return StepOutput(v.verdict.tokens, [[v.layers] * len(t) for t in v.verdict.tokens], hidden,
                          logprobs=self._logprobs(alive, keep, v))

    def _logprobs(self, alive: list[int], keep: list[list[int]], v: Verified) -> list[list | None] | None:
        """Per row, per committed token: its logprob entry, from the raw logits of the node it was chosen at
        (the root and the accepted nodes; after a T3 exit, the exit layer's); None for rows that ask none."""
        asks = [r for r, b in enumerate(alive) if self.batch.sampling[b].logprobs is not None]
        if not asks:
            return None
        m, dev = self.model, self.model.device
        rows = [r for r in asks for _ in keep[r]]
        nodes = torch.tensor([j for r in asks for j in keep[r]], device=dev)
        entries = self.batch.logprob_entries(m.lm_head(v.hn[torch.tensor(rows, device=dev), nodes]),
                                             [alive[r] for r in rows], [t for r in asks for t in v.verdict.tokens[r]])
        out: list = [None] * len(alive)
        i = 0
        for r in asks:
            out[r] = entries[i : i + len(keep[r])]
            i += len(keep[r])
        return out

    def _fill_skipped_layers(self, rows, start: torch.Tensor, nodes: torch.Tensor, counts: torch.Tensor,
                             v: Verified) -> None:
        """The layers a T3 exit skipped hold nothing for the block: write the kept nodes' K/V there from
        their exit hidden states, at their positions start + 0, 1, ..."""
        m, dev = self.model, self.model.device
        n, a = nodes.shape
        row_idx = torch.arange(n) if rows is None else rows.cpu()
        self.cache.truncate(row_idx, start, first_layer=v.layers)
        h = v.h.gather(1, nodes.clamp(min=0).to(dev)[:, :, None].expand(n, a, v.h.shape[-1]))  # [N, A, D]
        rope = m.rope_for((start[:, None] + torch.arange(a)).to(dev))
        n_valid = None if bool((counts == a).all()) else counts
        for layer in range(v.layers, m.num_layers):
            m.write_kv(layer, h, rope, self.cache, rows, n_valid)

    def row_stats(self, b: int) -> dict:
        s = self.stats
        total = max(s.t_draft + s.t_verify + s.t_commit, 1e-9)
        steps = max(s.per_row_steps[b], 1)
        plan = {} if self.planner is None else self.planner.summary()
        return {**plan, "spec_steps": s.per_row_steps[b], "mean_accepted": s.per_row_accepted[b] / steps,
                "mean_tokens_per_step": (s.per_row_accepted[b] + s.per_row_steps[b]) / steps,
                "forced_drafted": s.per_row_forced[b],
                "draft_time_share": s.t_draft / total, "verify_time_share": s.t_verify / total,
                "commit_time_share": s.t_commit / total}
