"""The data of one SpecEE decode step: what it starts from (Proposal), the exit test over the candidates
(CandidateScorer), the layer walk of the rows still running (Walk), what it decided (Decisions), an exited position
whose deeper layers lack KV (Pending) and a row's running statistics (RowStats)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specee_core.early_exit.predictors import (LayerPredictor, candidate_probs, exit_choice, exit_probability,
                                               predictor_features)


class CandidateScorer:
    """The exit test of one decode step for rows with candidates cand [N, K].

    On CUDA (or backend="triton") each call is one fused Triton launch (kernels.predictor).
    Otherwise the candidate LM-head rows are gathered once per step with the final RMSNorm's
    weight folded in, so a layer's candidate logits are a norm scalar and one batched dot
    product; features and MLP are specee_core.early_exit.predictors' (as in kernels.fused_predictor_reference)."""

    def __init__(self, model, cand: torch.Tensor, backend: str, draft_prob: torch.Tensor | None = None,
                 exit_token: str = "local", record: torch.Tensor | None = None):
        self.model, self.cand, self.draft_prob = model, cand, draft_prob  # draft_prob [N, K]: feature set "zpdq"
        self.record = record  # [N, K]: feature set "zpdqh"
        self.exit_token = exit_token  # what an exit emits (predictors.exit_choice): the bank's
        dev = model.device
        # the fused kernel reads a dense head; a low-bit head's rows are dequantized here instead
        dense_head = isinstance(model.w.lm_head, torch.Tensor)
        self.fused = dense_head and (backend == "triton" or (backend == "auto" and dev.type == "cuda"))
        self._w = None  # the torch path's candidate rows, gathered on first use

    def _logits(self, h: torch.Tensor, sel: torch.Tensor | None) -> torch.Tensor:
        """Candidate logits z [n, K] of pre-norm hidden states h [n, D] of the rows sel: the candidates'
        LM-head rows with the final norm's weight folded in (gathered once per step), a norm scalar and
        one batched dot product."""
        if self._w is None:
            self._w = (self.model.head_rows(self.cand) * self.model.w.norm).float()  # [N, K, D]
        hf = h.float()
        r = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + self.model.config.rms_norm_eps)  # [n, 1]
        w = self._w if sel is None else self._w[sel]
        return torch.bmm(w, hf.unsqueeze(-1)).squeeze(-1) * r

    def probs(self, h: torch.Tensor, sel: torch.Tensor | None) -> torch.Tensor:
        """The candidate probabilities [n, K] of pre-norm hidden states h [n, D] of the rows sel: a
        predictor's previous-layer input (its feature p - prev)."""
        return candidate_probs(self._logits(h, sel))

    def __call__(self, h: torch.Tensor, sel: torch.Tensor | None, prev: torch.Tensor,
                 pred: LayerPredictor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [n, D] pre-norm hidden of the rows `sel` [n] (indices into N; None = all N rows),
        prev [n, K] -> (p_exit [n], prob [n, K], the token an exit would emit [n])."""
        m = self.model
        cand = self.cand if sel is None else self.cand[sel]
        q = self.draft_prob if self.draft_prob is None or sel is None else self.draft_prob[sel]
        rec = self.record if self.record is None or sel is None else self.record[sel]
        if self.fused:
            from kernels import predictor_forward

            # the kernel reads rows at stride D; the fp32 CPU norm returns a strided view
            p_exit, p, local = predictor_forward(m.final_norm(h).contiguous(), cand, m.w.lm_head, prev, pred.w1,
                                                 pred.b1, pred.w2, pred.b2, backend="triton", draft_prob=q,
                                                 record=rec)
            return p_exit, p, local if self.exit_token == "local" else exit_choice(p, cand, self.exit_token)
        z = self._logits(h, sel)
        x, p = predictor_features(z, prev, q, rec)
        return exit_probability(x, pred), p, exit_choice(z, cand, self.exit_token)


@dataclass
class Pending:
    """An exited position whose deeper layers still lack KV ("recompute"): its hidden state is
    the input of layer index `next_layer`."""
    position: int
    next_layer: int
    h: torch.Tensor  # [D]


@dataclass
class RowStats:
    predictor_calls: int = 0
    explore_histogram: list[int] = field(default_factory=list)
    # live audit, per exit layer (index l - 1): exits run on to full depth, and those whose token
    # the full model would not have chosen
    audit_exits: list[int] = field(default_factory=list)
    audit_disagree: list[int] = field(default_factory=list)

    @classmethod
    def empty(cls, num_layers: int) -> RowStats:
        return cls(explore_histogram=[0] * num_layers, audit_exits=[0] * num_layers, audit_disagree=[0] * num_layers)


# One decode step has N "step rows": step row j is batch row alive[j] (and cache row alive[j]).
# While layers run, the rows still running are the rows of Walk.h, r -> step row Walk.running[r].


@dataclass
class Proposal:
    """What a step starts from: the alive rows, the tokens they feed, the proposer's candidates."""
    alive: list[int]  # the batch rows of the step's N rows
    idx: torch.Tensor | None  # [N] alive on the device; None when every batch row is alive
    tokens: torch.Tensor  # [N] the tokens fed this step
    cand: torch.Tensor  # [N, K] candidate token ids
    draft_prob: torch.Tensor | None  # [N, K] the draft head's probabilities of them, when the predictors read them
    record: torch.Tensor | None  # [N, K] the draft's recent record (DraftRecord.features), when the predictors read it
    lookup: torch.Tensor | None  # [N] prompt lookup's next token (-1: no match), when the calibration's veto needs it
    explore: bool  # every predictor runs this step (unbiased exit statistics for re-tuning)
    audit: bool  # exited rows run on to full depth and are compared with the full model's argmax


@dataclass
class Walk:
    """The layer walk of one step: the rows still running layers and what the predictors have seen."""
    h: torch.Tensor  # [n, 1, D] hidden states of the n running rows
    rope: tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each [n, 1, 1, D/H], of the running rows
    running: list[int]  # row r of h is step row running[r] (ascending)
    cache_rows: torch.Tensor | None  # [n] cache rows of the running rows; None: every cache row
    pred_layers: list[frozenset[int]]  # per step row: the layers after which its predictor runs
    scorer: CandidateScorer  # the exit test over the proposal's candidates
    prev: torch.Tensor  # [N, K] candidate probabilities at the layer below each row's next predictor (zeros at layer 1)
    done: list[bool]  # [N] exited, but still running layers (skip "batch")


@dataclass
class Decisions:
    """What a step decided per step row."""
    tokens: torch.Tensor  # [N]
    layers: list[int]  # [N] the exit layer; L when every layer ran
    hidden: torch.Tensor  # [N, D] the final-normed hidden state whose logits chose the token
    choice: torch.Tensor  # [N] the exit's greedy choice (what the audit compares; = tokens when greedy)
