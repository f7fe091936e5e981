"""SpecEE T3: early exit inside speculative verification, with merged candidate mapping.

At the scheduled layers of the verify forward, every drafted node whose next tokens the draft ranked
(its K candidates, `Draft.cand`) is scored by that layer's exit predictor (SpecEE T1's features on
the candidates' LM-head rows). The tokens the exits would emit (the candidate-local argmaxes, or the
draft's top candidates for predictors whose exits emit those) stand in for the base model's choices:
the path they accept, with the token after it, is the row's hyper-token, and it may exit only when
every member's predictor fires (its weakest member decides). When every row's block may exit, the
remaining layers are skipped for the whole block; the kept nodes' KV of the skipped layers is then
computed from the exit hidden state (DecoderModel.write_kv). Lossy, like T1+T2; greedy only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specee_core.spec.acceptance import Verdict, accept_greedy
from specee_core.early_exit.step import EarlyExit
from specee_core.early_exit.walk import CandidateScorer
from specee_core.early_exit.predictors import PredictorBank
from specee_core.draft.tree import Draft


@dataclass
class T3:
    predictors: PredictorBank
    layers: frozenset[int]  # 1-based layers after which the block's exit is tested
    threshold: float
    backend: str

    @classmethod
    def of(cls, ee: EarlyExit, width: int) -> T3:
        """The predictors, offline schedule layers and threshold of mode="specee"; the draft must rank
        as many candidates per node as the predictors were trained on."""
        if width != ee.predictors.k:
            raise ValueError(f"t3 scores the draft's top-{width} per node; the predictors expect "
                             f"{ee.predictors.k}: use width={ee.predictors.k}")
        layers = frozenset(ee.schedule.offline_layers) & frozenset(ee.predictors.layers)
        return cls(ee.predictors, layers, ee.options.threshold, ee.options.predictor_backend)


@dataclass
class Verified:
    h: torch.Tensor  # [N, T, D] hidden states after the last layer run
    hn: torch.Tensor  # [N, T, D] the same, final-normed (the draft head's features)
    verdict: Verdict
    layers: int  # layers run (num_layers: no exit)


def verify_with_exits(model, cache, draft: Draft, positions: torch.Tensor, anc: torch.Tensor,
                      rows: torch.Tensor | None, t3: T3) -> Verified:
    """The verify forward of draft (positions [N, T], ancestors [N, T, T]) with T3 exits."""
    m, dev, L = model, model.device, model.num_layers
    known = (draft.cand[..., 0] >= 0) & draft.valid  # [N, T] nodes with ranked candidates
    known_dev = known.to(dev)
    q = None
    if t3.predictors.reads_draft_prob:
        if draft.cand_prob is None:
            raise ValueError("these exit predictors read the draft's candidate probabilities, which this draft lacks")
        q = draft.cand_prob[known].to(dev)
    # the draft's record (feature set "zpdqh") is not kept along a tree's paths: every node reads none, as
    # a row's first step does (the predictors are at their most cautious there)
    rec = torch.zeros(int(known.sum()), t3.predictors.k, device=dev) if t3.predictors.reads_record else None
    scorer = (CandidateScorer(m, draft.cand[known].to(dev), t3.backend, q, t3.predictors.exit_token, rec)
              if bool(known.any()) else None)
    prev = torch.zeros(int(known.sum()), t3.predictors.k, device=dev)  # [S, K]
    h = m.embed(draft.tokens.to(dev))
    rope = m.rope_for(positions)
    for i in range(L):
        if scorer is not None and 0 < i < L - 1 and i + 1 in t3.layers:  # the feature compares adjacent layers
            prev = scorer.probs(h[known_dev], None)
        h = m.layer(i, h, rope, cache, rows, tree=anc)
        layer = i + 1
        if scorer is None or layer == L or layer not in t3.layers:
            continue
        p_exit, _, local = scorer(h[known_dev], None, prev, t3.predictors.layers[layer])
        nxt = torch.full(known.shape, -1, dtype=torch.int64)
        nxt[known] = local.cpu()
        fired = torch.zeros(known.shape, dtype=torch.bool)
        fired[known] = (p_exit > t3.threshold).cpu()
        verdict = accept_greedy(draft, nxt)  # a node without candidates ends any path (no match, token -1)
        ok = fired.tolist()
        if all(tokens[-1] >= 0 and all(ok[r][j] for j in [0] + path)
               for r, (path, tokens) in enumerate(zip(verdict.accepted, verdict.tokens))):
            return Verified(h, m.final_norm(h), verdict, layer)
    hn = m.final_norm(h)
    return Verified(h, hn, accept_greedy(draft, m.lm_head(hn).max(-1).indices.cpu()), L)
