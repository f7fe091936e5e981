"""Full-depth decoding that records, at every layer, the candidate logits the exit predictors
see: the training data of the predictors and the candidates' hit rates."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from specee_core.early_exit.predictors import DraftRecord, candidate_probs, exit_choice, predictor_features
from specee_core.step.sampling import SamplingParams
from specee_core.draft.proposer import Proposer
from specee_core.step.stepper import StepOutput

log = logging.getLogger(__name__)


@dataclass
class ExitData:
    z: list[torch.Tensor] = field(default_factory=list)  # per step [N, L-1, K] candidate logits after layer l
    cand: list[torch.Tensor] = field(default_factory=list)  # per step [N, K]
    final: list[torch.Tensor] = field(default_factory=list)  # per step [N] the full-depth token
    q: list[torch.Tensor] = field(default_factory=list)  # per step [N, K] the draft head's candidate probabilities
    record: list[torch.Tensor] = field(default_factory=list)  # per step [N, K] the draft's record (k >= 3)
    # per step [N, K] the candidates a second draft head (a shadow) proposes from the same inputs, when given
    shadow: list[torch.Tensor] = field(default_factory=list)
    # per step [N, LOOKUP_NGRAM]: per n = 1..3, the token that followed the latest earlier occurrence of the
    # row's last n tokens (prompt lookup), -1 where none (what the calibration's lookup veto compares with)
    lookup: list[torch.Tensor] = field(default_factory=list)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(z [S, L-1, K], cand [S, K], final [S], q [S, K] or None when the candidates are lookup's,
        record [S, K] or None for k < 3)."""
        q = torch.cat(self.q) if self.q and len(self.q) == len(self.z) else None
        record = torch.cat(self.record) if self.record and len(self.record) == len(self.z) else None
        return torch.cat(self.z), torch.cat(self.cand), torch.cat(self.final), q, record

    def lookups(self) -> torch.Tensor:
        """[S, LOOKUP_NGRAM] int64, in the order of tensors()' steps."""
        return torch.cat(self.lookup)


class Progress:
    """Logs tokens decoded of a known total, at most once per `every_s` seconds (long collections show progress)."""

    def __init__(self, total: int, every_s: float = 30.0):
        self.total, self.every_s, self.done = total, every_s, 0
        self.t0 = self.last = time.perf_counter()

    def tick(self, tokens: int) -> None:
        self.done += tokens
        now = time.perf_counter()
        if now - self.last >= self.every_s:
            self.last = now
            rate = self.done / (now - self.t0)
            log.info("collected %d of %d tokens (%.0f%%, %.0f tokens/s, ~%.0f min left)", self.done, self.total,
                     100 * self.done / self.total, rate, (self.total - self.done) / max(rate, 1e-9) / 60)


class CollectStepper:
    """Runs every layer (dense output), and after each layer l < L records z_l = the final-normed
    hidden state projected on the k candidate rows of the LM head. Candidates as mode="specee" gets them
    (source, draft, k: EarlyExit's); shadow: a second draft head whose top-k from the same inputs is recorded."""

    def __init__(self, source: str, draft, k: int, shadow, data: ExitData, progress: Progress | None, engine, batch,
                 cache, prefill_hidden, lens):
        self.source, self.k, self.data, self.batch, self.cache = source, k, data, batch, cache
        self.progress = progress
        self.model = m = engine.model
        self.record = DraftRecord(batch.size)  # as the SpecEE stepper keeps it
        self.features = m.final_norm(batch.last_hidden)  # [B, D] feature of each row's last fed position
        self.proposer = Proposer(draft, batch.size, cache.max_len, m.device)
        self.shadow = None if shadow is None else Proposer(shadow, batch.size, cache.max_len, m.device)

    @torch.inference_mode()
    def step(self, alive, rows):
        m, batch = self.model, self.batch
        idx = torch.tensor(alive, device=m.device)
        toks = batch.next_tokens[idx]
        for p in (self.proposer, self.shadow):
            if p is not None:
                p.push(alive, [[t] for t in toks.tolist()], list(self.features[idx].split(1)))
        cand, q = self.proposer.candidates(alive, batch, self.k, self.source)  # [N, K] each
        if self.shadow is not None:
            self.data.shadow.append(self.shadow.candidates(alive, batch, self.k, "draft")[0].cpu())
        self.data.lookup.append(self.proposer.followers(alive, batch))
        if cand.shape[1] >= 3:
            self.data.record.append(self.record.step(alive, toks.tolist(), cand))
        w_cand = m.head_rows(cand)  # [N, K, D]
        h = m.embed(toks[:, None])
        rope = m.rope_for(batch.positions[idx.cpu()].to(m.device)[:, None])
        zs = []
        for i in range(m.num_layers):
            h = m.layer(i, h, rope, self.cache, rows)
            if i + 1 < m.num_layers:
                zs.append(torch.einsum("nd,nkd->nk", m.final_norm(h[:, 0]), w_cand).float())
        hn = m.final_norm(h[:, 0])
        tok = m.lm_head(hn).argmax(-1)
        self.data.z.append(torch.stack(zs, 1).cpu())
        self.data.cand.append(cand.cpu())
        self.data.final.append(tok.cpu())
        if q is not None:
            self.data.q.append(q.float().cpu())
        self.features[idx] = hn
        if self.progress is not None:
            self.progress.tick(len(alive))
        return StepOutput([[t] for t in tok.tolist()], [[m.num_layers]] * len(alive))

    def admit(self, rows: list[int], prefill_hidden: torch.Tensor, lens: torch.Tensor) -> None:
        self.record.clear(rows)
        idx = torch.tensor(rows, device=self.model.device)
        self.features[idx] = self.model.final_norm(self.batch.last_hidden[idx])
        for p in (self.proposer, self.shadow):
            if p is not None:
                p.admit(self.batch, rows, prefill_hidden, lens)

    def caches(self) -> list:
        return self.proposer.caches() + ([] if self.shadow is None else self.shadow.caches())

    def row_stats(self, b: int) -> dict:
        return {}


def collect_exit_data(engine, prompts: list[str], source: str, k: int, max_new_tokens: int = 128,
                      shadow=None) -> ExitData:
    """Greedy full-depth decoding of prompts with k candidates per step recorded, from `source` ("draft":
    the engine's draft head, "lookup": prompt lookup completed from it); shadow: a second DraftModel whose
    candidates are recorded beside (ExitData.shadow)."""
    data = ExitData()
    ids = [engine.encode_prompt(p) for p in prompts]
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    progress = Progress(len(ids) * max_new_tokens)
    engine.run(ids, params, lambda *a: CollectStepper(source, engine.draft, k, shadow, data, progress, *a))
    return data


def exit_labels(z: torch.Tensor, cand: torch.Tensor, final: torch.Tensor, exit_token: str = "local") -> torch.Tensor:
    """[S, L-1] bool: the token an exit after layer l emits (predictors.exit_choice) is the full-depth
    token (so exiting there changes nothing)."""
    return exit_choice(z, cand, exit_token) == final[:, None]


def hit_rates(cand: torch.Tensor, final: torch.Tensor) -> dict:
    """Candidate quality: the final token is the first candidate / among the k."""
    return {"top1": (cand[:, 0] == final).float().mean().item(),
            "topk": (cand == final[:, None]).any(1).float().mean().item(), "k": cand.shape[1], "steps": len(final)}


def oracle_exit_layers(labels: torch.Tensor, num_layers: int) -> torch.Tensor:
    """[S] the first layer from which every deeper layer's label holds (num_layers if none)."""
    s, l1 = labels.shape
    ok_from = torch.ones(s, dtype=torch.bool)
    first = torch.full((s,), num_layers)
    for l in range(l1 - 1, -1, -1):
        ok_from &= labels[:, l]
        first = torch.where(ok_from, torch.tensor(l + 1), first)
    return first


def predictor_dataset(z: torch.Tensor, labels: torch.Tensor, layer: int, max_gap: int = 1,
                      seed: int = 0, draft_prob: torch.Tensor | None = None,
                      record: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Features [S, 3K] (with draft_prob [S, K], the draft head's candidate probabilities: [S, 4K]; and the
    draft's record [S, K]: [S, 5K]) and
    labels [S] for the predictor after layer `layer` (1-based). The shift uses the probabilities of
    the layer below, as the engine computes them before a predictor's layer (max_gap > 1: of a layer
    1..max_gap below, random per sample); zeros at layer 1."""
    g = torch.Generator().manual_seed(seed + layer)
    s = z.shape[0]
    zl = z[:, layer - 1]
    gap = torch.randint(1, max_gap + 1, (s,), generator=g)
    below = layer - gap  # 1-based layer of the previous predictor; < 1: none
    prev = torch.zeros_like(zl)
    has = below >= 1
    if has.any():
        prev[has] = candidate_probs(z[has.nonzero().squeeze(1), below[has] - 1])
    x, _ = predictor_features(zl, prev, draft_prob, record)
    return x, labels[:, layer - 1].float()
