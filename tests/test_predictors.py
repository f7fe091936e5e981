"""specee_core.early_exit.predictors: one definition of the exit predictor's math (features, MLP), the same
bits whether training, the engine's CPU scorer or the kernel's torch reference computes it."""
from __future__ import annotations

import torch

from kernels import fused_predictor_reference
from specee_core.early_exit.collect import predictor_dataset
from specee_core.early_exit.predictors import (ExitMLP, PredictorBank, candidate_probs, exit_probability,
                                               predictor_features)

K = 4


def test_features_are_logits_probabilities_and_shift():
    g = torch.Generator().manual_seed(0)
    z, prev = torch.randn(6, K, generator=g) * 3, candidate_probs(torch.randn(6, K, generator=g))
    x, p = predictor_features(z, prev)
    assert x.shape == (6, 3 * K) and x.dtype == torch.float32
    torch.testing.assert_close(p, torch.softmax(z, -1), rtol=0, atol=0)
    assert torch.equal(x[:, :K], z) and torch.equal(x[:, K : 2 * K], p) and torch.equal(x[:, 2 * K :], p - prev)


def test_training_module_saved_bank_and_kernel_reference_agree_bit_for_bit():
    torch.manual_seed(0)
    mlp = ExitMLP(3 * K)
    pred = PredictorBank.from_mlps(K, {3: mlp}).layers[3]
    g = torch.Generator().manual_seed(1)
    h, lm = torch.randn(6, 32, generator=g), torch.randn(50, 32, generator=g)
    cand, prev = torch.randint(0, 50, (6, K), generator=g), candidate_probs(torch.randn(6, K, generator=g))
    z = torch.einsum("nd,nkd->nk", h, lm[cand])  # [N, K]
    x, p = predictor_features(z, prev)
    p_exit = exit_probability(x, pred)
    with torch.no_grad():
        assert torch.equal(p_exit, torch.sigmoid(mlp(x)))  # what training optimised
    ref_exit, ref_p, _ = fused_predictor_reference(h, cand, lm, prev, pred.w1, pred.b1, pred.w2, pred.b2)
    assert torch.equal(ref_exit, p_exit) and torch.equal(ref_p, p)


def test_training_features_use_the_shared_definition():
    g = torch.Generator().manual_seed(2)
    z = torch.randn(40, 5, K, generator=g)  # [S, L-1, K]
    labels = torch.rand(40, 5, generator=g) > 0.5
    x1, y1 = predictor_dataset(z, labels, layer=1)  # no layer below: the shift is p itself
    assert torch.equal(x1, predictor_features(z[:, 0], torch.zeros(40, K))[0])
    assert torch.equal(y1, labels[:, 0].float())
    x3, _ = predictor_dataset(z, labels, layer=3, max_gap=1)  # the previous predictor one layer down
    assert torch.equal(x3, predictor_features(z[:, 2], candidate_probs(z[:, 1]))[0])
