"""Exit thresholds calibrated to a stated tolerance (SpecEE with a quality contract).

A token that exits at layer l emits the candidate-local argmax there; it *disagrees* when that is
not the full model's argmax. For a tolerance eps and confidence 1 - delta, each layer gets the
lowest exit threshold whose disagreement rate among the tokens it lets exit stays <= eps, tested
on calibration data held out from the predictors' training (Learn-then-Test, as CALM calibrates
its exit threshold):

- per layer, the candidate thresholds are tested from the most to the least conservative (a fixed
  sequence; thresholds with too few exits to ever pass are left out, which depends on the scores
  only): H_j "the disagreement rate at threshold t_j exceeds eps" is rejected when the
  binomial Chernoff p-value exp(-n KL(k/n || eps)) of its k disagreements among n exits is
  <= delta / (number of layers); the first hypothesis not rejected ends the sequence;
- the threshold is the last one rejected; a layer with none never exits;
- Bonferroni over the layers: with probability >= 1 - delta no layer's rate exceeds eps.

The calibration file beside the predictors (calibration.json) keeps, per layer and candidate
threshold, the exits and disagreements counted on the calibration set, so any (eps, delta) is
derived at load without the data. The live audit of the batch job (pipeline.schedule_store)
uses the same bounds on the tokens it re-runs to full depth.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

CALIBRATION_FILE = "calibration.json"
# candidate thresholds on sigmoid(predictor), from the most to the least conservative
THRESHOLD_GRID = (0.9999, 0.9995, 0.999, 0.998, 0.995, 0.99, 0.98, 0.97, 0.95, 0.93, 0.9, 0.85, 0.8, 0.75,
                  0.7, 0.6, 0.5)


def check_tolerance(max_disagreement: float | None, confidence: float) -> None:
    """ValueError unless 0 < max_disagreement < 1 (or None) and 0 < confidence < 1."""
    if max_disagreement is not None and not 0.0 < max_disagreement < 1.0:
        raise ValueError(f"max_disagreement must be in (0, 1), got {max_disagreement}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")


def _kl(p: float, q: float) -> float:
    """KL divergence of Bernoulli(p) from Bernoulli(q)."""
    out = 0.0
    if p > 0:
        out += p * math.log(p / q)
    if p < 1:
        out += (1 - p) * math.log((1 - p) / (1 - q))
    return out


def p_value(disagree: int, n: int, eps: float) -> float:
    """Chernoff p-value of "rate > eps" after `disagree` disagreements in n trials: exp(-n KL) when
    the observed rate is below eps, else 1."""
    if n == 0 or disagree >= n * eps:
        return 1.0
    return math.exp(-n * _kl(disagree / n, eps))


def upper_bound(disagree: int, n: int, delta: float) -> float:
    """The Chernoff upper confidence bound (level 1 - delta) of a rate from `disagree` of n:
    the largest q >= k/n with n KL(k/n || q) <= log(1/delta); 1.0 when n = 0."""
    if n == 0:
        return 1.0
    p, target = disagree / n, math.log(1 / delta) / n
    lo, hi = p, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if mid >= 1.0 or _kl(p, mid) > target:
            hi = mid
        else:
            lo = mid
    return lo


def lower_bound(disagree: int, n: int, delta: float) -> float:
    """The Chernoff lower confidence bound (level 1 - delta): the smallest q <= k/n with
    n KL(k/n || q) <= log(1/delta); 0.0 when n = 0."""
    if n == 0:
        return 0.0
    p, target = disagree / n, math.log(1 / delta) / n
    lo, hi = 0.0, p
    for _ in range(60):
        mid = (lo + hi) / 2
        if mid <= 0.0 or _kl(p, mid) > target:
            lo = mid
        else:
            hi = mid
    return hi


@dataclass
class LayerCounts:
    """One layer's calibration counts: at thresholds[j], exits[j] tokens would exit and
    disagree[j] of them would emit another token than the full model."""
    thresholds: list[float]
    exits: list[int]
    disagree: list[int]


@dataclass
class Calibration:
    """The counts of every layer with a predictor, over `tokens` calibration tokens from `prompts`
    prompts never used to train the predictors."""
    layers: dict[int, LayerCounts]
    tokens: int
    prompts: int
    source: str = ""
    meta: dict = field(default_factory=dict)

    @classmethod
    def count(cls, p_exit: dict[int, torch.Tensor], agree: dict[int, torch.Tensor], prompts: int,
              source: str = "", grid: tuple[float, ...] = THRESHOLD_GRID, meta: dict | None = None) -> Calibration:
        """From each layer's exit probabilities p_exit[l] [S] and whether its candidate-local argmax
        is the full model's token agree[l] [S] (bool)."""
        layers, tokens = {}, 0
        for l, p in p_exit.items():
            bad = ~agree[l]
            tokens = max(tokens, len(p))
            fired = [p > t for t in grid]
            layers[l] = LayerCounts(list(grid), [int(f.sum()) for f in fired], [int((f & bad).sum()) for f in fired])
        return cls(layers, tokens, prompts, source, meta or {})

    def thresholds(self, eps: float, confidence: float = 0.95) -> dict[int, CalibratedLayer]:
        """Per layer: the lowest threshold certified at eps with confidence (see the module docstring),
        or threshold None (never exits)."""
        check_tolerance(eps, confidence)
        delta = (1 - confidence) / max(len(self.layers), 1)
        # a threshold with fewer exits than this cannot pass even without a disagreement; leaving it out
        # of the sequence depends on the predictor's scores alone, not on the labels, so the sequence is
        # still fixed before the test looks at the disagreements
        min_exits = math.ceil(math.log(1 / delta) / -math.log(1 - eps))
        out = {}
        for l, c in sorted(self.layers.items()):
            chosen = None
            for j, t in enumerate(c.thresholds):
                if c.exits[j] < min_exits:
                    continue
                if p_value(c.disagree[j], c.exits[j], eps) > delta:
                    break
                chosen = j
            if chosen is None:
                out[l] = CalibratedLayer(None, 0, 0, None)
            else:
                n, k = c.exits[chosen], c.disagree[chosen]
                out[l] = CalibratedLayer(c.thresholds[chosen], n, k, upper_bound(k, n, delta))
        return out

    def save(self, path: str | Path) -> None:
        d = asdict(self)
        d["layers"] = {str(l): v for l, v in d["layers"].items()}
        Path(path).write_text(json.dumps(d, indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"calibration not found: {path}")
        try:
            d = json.loads(path.read_text())
            layers = {int(l): LayerCounts(**v) for l, v in d.pop("layers").items()}
            return cls(layers=layers, **d)
        except (json.JSONDecodeError, TypeError, KeyError, AttributeError) as e:
            raise ValueError(f"{path}: not a valid calibration file ({e})") from None


@dataclass
class CalibratedLayer:
    threshold: float | None  # None: the layer never exits at this tolerance
    exits: int  # calibration tokens that exit at the threshold
    disagree: int  # of them, those the full model would not have emitted
    bound: float | None  # the upper confidence bound of the rate (Bonferroni level)


def calibrate_command(model_dir) -> str:
    """How to make calibration.json for a model (the message of a tolerance asked without one)."""
    return (f"python -m jobs.train_predictors --model {model_dir} --prompts prompts/instructions_train.jsonl "
            f"--calib-prompts 250")
