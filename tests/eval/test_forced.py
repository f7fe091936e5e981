"""Teacher forcing through the engine's decode path: dense's likelihood of a reference text equals
one full transformers forward (fp32, the trained bundled model, where feeding the prefill's own
token or an off-by-one position would show), and early exit switched off equals dense."""
from __future__ import annotations

import math

import pytest
import torch

from specee_core import SpecEEEngine
from specee_core.decode.dense import DenseStepper
from specee_core.step.sampling import SamplingParams
from specee_eval.forced import Forcing

from tests.conftest import BUNDLED

TEXTS = ["def add(a, b):\n    return a + b\n\n\nprint(add(1, 2))\n",
         "import os\n\n\ndef read(path):\n    with open(path) as f:\n        return f.read()\n",
         "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n"]


@pytest.fixture(scope="module")
def engine():
    return SpecEEEngine.from_pretrained(BUNDLED, dtype=torch.float32)


def _split(engine, texts):
    full = [engine.tokenizer(t)["input_ids"] for t in texts]
    cut = [len(f) // 3 for f in full]  # context: the first third of the tokens
    return [f[:c] for f, c in zip(full, cut)], [f[c:] for f, c in zip(full, cut)], full


def _reference_nll(full, ctx_lens):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(BUNDLED), dtype=torch.float32).eval()
    nll = tokens = hits = 0
    with torch.no_grad():
        for ids, c in zip(full, ctx_lens):
            logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
            # positions c .. len-2 predict ids[c+1 ..]: the targets after the first (which the prefill predicts)
            pred = logp[c : len(ids) - 1]
            truth = torch.tensor(ids[c + 1 :])
            nll -= pred.gather(1, truth[:, None]).sum().item()
            hits += (pred.argmax(-1) == truth).sum().item()
            tokens += len(truth)
    return nll, tokens, hits


def test_dense_forcing_equals_a_full_forward(engine):
    ctx, targets, full = _split(engine, TEXTS)
    probe = Forcing(targets, engine.model)
    probe.register(ctx)
    engine.run(ctx, SamplingParams(max_new_tokens=64, ignore_eos=True), probe.factory(DenseStepper))
    nll, tokens, hits = _reference_nll(full, [len(c) for c in ctx])
    assert probe.tokens == tokens
    assert probe.hits == hits
    assert probe.nll == pytest.approx(nll, rel=1e-4)
    assert probe.perplexity == pytest.approx(math.exp(nll / tokens), rel=1e-4)
    assert probe.layers == tokens * engine.config.num_hidden_layers


def test_early_exit_switched_off_has_dense_likelihood_and_exits_lower_it(engine):
    ctx, targets, _ = _split(engine, TEXTS)
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)

    def forced(inner):
        probe = Forcing(targets, engine.model)
        probe.register(ctx)
        engine.run(ctx, params, probe.factory(inner))
        return probe

    dense = forced(DenseStepper)
    off = forced(engine.with_options(threshold=2.0).early_exit.new_stepper)
    assert off.nll == pytest.approx(dense.nll, rel=1e-4) and off.hits == dense.hits
    eager = forced(engine.with_options(threshold=0.0).early_exit.new_stepper)  # the first predictor always fires
    assert eager.layers < dense.layers and eager.nll > dense.nll
