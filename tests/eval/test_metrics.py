"""The evaluation's metrics on hand-made cases with known answers."""
from __future__ import annotations

import math

import pytest

from specee_eval import metrics


def test_agreement_on_a_hand_made_case():
    dense = [[1, 2, 3, 4], [5, 6, 7], [8, 9]]
    other = [[1, 2, 3, 4], [5, 0, 7, 1], [8]]
    a = metrics.agreement(dense, other)
    assert a["identical"] == pytest.approx(1 / 3)
    # first divergences: 4 (identical), 1, 1 (a prefix of dense)
    assert a["first_divergence_mean"] == pytest.approx(2.0)
    assert a["first_divergence_median"] == 1
    assert a["prefix_agreement"] == pytest.approx(6 / 9)
    # positions up to the shorter length: 4 + 3 + 1 = 8, equal at 4 + 2 + 1 = 7
    assert a["token_agreement"] == pytest.approx(7 / 8)


def test_first_divergence_edges():
    assert metrics.first_divergence([1, 2], [1, 2]) == 2
    assert metrics.first_divergence([1, 2], [1, 2, 3]) == 2
    assert metrics.first_divergence([1, 2], [0, 2]) == 0
    assert metrics.first_divergence([], []) == 0


def test_pass_at_1_outcomes_and_perplexity():
    assert metrics.pass_at_1([True, False, False, True]) == 0.5
    assert metrics.outcome_agreement([True, False, True], [True, True, True]) == pytest.approx(2 / 3)
    assert metrics.perplexity(3 * math.log(4), 3) == pytest.approx(4.0)
    assert metrics.speed(100, 4.0) == 25.0
    with pytest.raises(ValueError):
        metrics.agreement([[1]], [])
