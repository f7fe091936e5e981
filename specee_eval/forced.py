"""Teacher forcing through the engine's own decode path: a wrapper Stepper that feeds a reference
text's tokens instead of the chosen ones, so a decoding mode (dense, or early exit with its exit
layers) is scored on text it did not write: next-token accuracy and negative log-likelihood of
the distribution it decided from.

    probe = Forcing(targets, engine.model)
    probe.register(contexts)
    engine.run(contexts, SamplingParams(max_new_tokens=..., ignore_eos=True), probe.factory(inner_factory))

The likelihood is that of the LM head over the hidden state the stepper chose from: the last
layer's for dense, the exit layer's for early exit (StepOutput.normed).

Call register(contexts) first. Row b's steps predict targets[b][1:], each fed the true previous
token (targets[b][0] is fed in place of the prefill's choice, which is not scored); a row stops
where its targets end.
"""
from __future__ import annotations

import math
import torch

from specee_core.step.stepper import StepOutput


class Forcing:
    """Totals over every forced step: hits (argmax == truth), tokens, nll (nats), layers run."""

    def __init__(self, targets: list[list[int]], model=None, on_step=None):
        self.targets = targets
        self.model = model  # its LM head gives the likelihood; None: accuracy only
        self.on_step = on_step  # on_step(decided: StepOutput, truths: list[int]) after every step
        self.hits = self.tokens = self.layers = 0
        self.nll = 0.0

    def factory(self, inner_factory):
        """A StepperFactory whose steppers wrap inner_factory's; targets are matched to the rows by their
        prompts as rows are admitted."""
        def build(engine, batch, cache, prefill_hidden, lens):
            return _Forced(self, inner_factory(engine, batch, cache, prefill_hidden, lens), batch)
        return build

    def register(self, prompts: list[list[int]]) -> None:
        self._rows = {tuple(p): i for i, p in enumerate(prompts)}
        if len(self._rows) != len(prompts):
            raise ValueError("forced prompts must be distinct (targets are found by prompt)")

    def _row_of(self, prompt: list[int]) -> int:
        return self._rows[tuple(prompt)]

    @property
    def accuracy(self) -> float:
        return self.hits / max(self.tokens, 1)

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.tokens) if self.tokens else float("nan")


class _Forced:
    def __init__(self, probe: Forcing, inner, batch):
        self.probe, self.inner, self.batch = probe, inner, batch
        self.rows: dict[int, int] = {}  # batch row -> target row
        self.fresh: set[int] = set()  # rows not stepped yet: the prefill's choice is replaced

    def admit(self, rows: list[int], prefill_hidden: torch.Tensor, lens: torch.Tensor) -> None:
        batch = self.batch
        for b in rows:  # each row stops where its reference text ends
            self.rows[b] = self.probe._row_of(batch.prompt(b))
            batch.max_new[b] = min(batch.max_new[b], len(self.probe.targets[self.rows[b]]))
            self.fresh.add(b)
        self.inner.admit(rows, prefill_hidden, lens)

    def caches(self) -> list:
        return self.inner.caches()

    def step(self, alive, rows) -> StepOutput:
        batch, p = self.batch, self.probe
        truths = [p.targets[self.rows[b]][batch.n_generated(b)] for b in alive]
        if first := [b for b in alive if b in self.fresh]:  # the prefill's own choice was fed: feed the truth
            idx = torch.tensor(first, device=batch.next_tokens.device)
            batch.next_tokens[idx] = torch.tensor([p.targets[self.rows[b]][0] for b in first],
                                                  device=batch.next_tokens.device)
            self.fresh.difference_update(first)
        out = self.inner.step(alive, rows)
        if p.on_step is not None:  # what the stepper chose, before the true tokens replace it
            p.on_step(out, truths)
        truth_t = torch.tensor(truths, device=batch.next_tokens.device)
        p.hits += sum(block[0] == t for block, t in zip(out.tokens, truths))
        p.tokens += len(truths)
        p.layers += sum(l[0] for l in out.layers)
        normed = out.normed if out.normed is not None else None if out.hidden is None else p.model.final_norm(out.hidden)
        if p.model is not None and normed is not None:
            logp = torch.log_softmax(p.model.lm_head(normed).float(), dim=-1)
            p.nll -= logp.gather(1, truth_t[:, None]).sum().item()
        return StepOutput([[t] for t in truths], [l[:1] for l in out.layers], out.hidden)

    def row_stats(self, b: int) -> dict:
        return self.inner.row_stats(b)
