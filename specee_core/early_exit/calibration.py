"""Exit thresholds calibrated to a stated tolerance (SpecEE with a quality contract).

A token that exits at layer l emits the candidate-local argmax there; it *disagrees* when that is
not the full model's argmax. For a tolerance eps and confidence 1 - delta, each layer gets the
lowest exit threshold whose disagreement rate among the tokens it lets exit stays <= eps, tested
on calibration data held out from the predictors' training (Learn-then-Test, as CALM calibrates
its exit threshold):

- per layer, the candidate thresholds are tested from the most to the least conservative (a fixed
  sequence; thresholds with too few exits to pass at half the tolerance are left out, which
  depends on the scores only): H_j "the disagreement rate at threshold t_j exceeds eps" is rejected when the exact
  binomial p-value P(X <= k | n, eps) of its k disagreements among n exits is <= delta / (number
  of layers), i.e. when the Clopper-Pearson upper bound is below eps; the first hypothesis not
  rejected ends the sequence (a finer grid costs no confidence);
- the threshold is the last one rejected; a layer with none never exits;
- Bonferroni over the layers: with probability >= 1 - delta no layer's rate exceeds eps.

The lookup veto (Calibration.lookup_veto): where prompt lookup finds the row's last n >= lookup_veto tokens
earlier in its prompt or output and the exit's token is not the one that followed them, the exit is not
taken (the text is being copied, and the draft's confident candidate would rewrite it). The calibration
sets such tokens' exit probability at that layer to 0, so the thresholds are certified on exactly the
exits the engine can take, and the engine applies the rule whenever it uses these thresholds.

Layers are calibrated from the shallowest up, each on the calibration tokens that no shallower layer
let exit (at run time a deeper predictor sees only the tokens that did not exit below it). The
calibration file beside the predictors (calibration.safetensors) keeps, per calibration token and
predictor layer, the exit probability and whether the exit would agree with the full model (about
3 MB for SmolLM2's 23.7k tokens x 29 layers), so thresholds for any (eps, delta) are derived at load. The live audit of the batch job (pipeline.schedule_store)
uses the same bounds on the tokens it re-runs to full depth.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

CALIBRATION_FILE = "calibration.safetensors"
# candidate thresholds on sigmoid(predictor), from the most to the least conservative: fine where
# the predictors' confident exits are (a longer fixed sequence costs no confidence)
THRESHOLD_GRID = (0.9999, 0.9995, 0.999, 0.998, 0.997, 0.996, 0.995, 0.9925, 0.99,
                  *(round(0.985 - 0.005 * i, 3) for i in range(18)), 0.875, 0.85, 0.825, 0.8, 0.75, 0.7, 0.6, 0.5)


def check_tolerance(max_disagreement: float | None, confidence: float) -> None:
    """ValueError unless 0 < max_disagreement < 1 (or None) and 0 < confidence < 1."""
    if max_disagreement is not None and not 0.0 < max_disagreement < 1.0:
        raise ValueError(f"max_disagreement must be in (0, 1), got {max_disagreement}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-14:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def binom_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p)."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    return betainc(n - k, k + 1, 1.0 - p)


def p_value(disagree: int, n: int, eps: float) -> float:
    """Exact binomial p-value of "rate > eps" after `disagree` disagreements in n trials:
    P(X <= disagree) at rate eps (1 when n = 0)."""
    return 1.0 if n == 0 else binom_cdf(disagree, n, eps)


def _solve(f, lo: float, hi: float) -> float:
    """The q in [lo, hi] where the decreasing f crosses 0 (bisection)."""
    for _ in range(60):
        mid = (lo + hi) / 2
        if f(mid) > 0:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def upper_bound(disagree: int, n: int, delta: float) -> float:
    """The exact (Clopper-Pearson) one-sided upper confidence bound at level 1 - delta of a rate
    from `disagree` of n: the q with P_q(X <= disagree) = delta; 1.0 when n = 0."""
    if n == 0 or disagree >= n:
        return 1.0
    return _solve(lambda q: binom_cdf(disagree, n, q) - delta, disagree / n, 1.0)


def lower_bound(disagree: int, n: int, delta: float) -> float:
    """The exact one-sided lower confidence bound at level 1 - delta: the q with
    P_q(X >= disagree) = delta; 0.0 when there is no disagreement."""
    if n == 0 or disagree == 0:
        return 0.0
    return _solve(lambda q: delta - (1.0 - binom_cdf(disagree - 1, n, q)), 0.0, disagree / n)


@dataclass
class LayerCounts:
    """One layer's counts: at thresholds[j], exits[j] tokens would exit and disagree[j] of them would
    emit another token than the full model."""
    thresholds: list[float]
    exits: list[int]
    disagree: list[int]


@dataclass
class Calibration:
    """Per calibration token (never used to train the predictors) and predictor layer: the exit
    probability and whether the layer's exit choice agrees with the full model. `prompts`: how many
    prompts the `tokens` tokens came from."""
    layers: list[int]  # the predictor layers, ascending (columns of p_exit / agree)
    p_exit: torch.Tensor  # [S, len(layers)] float32
    agree: torch.Tensor  # [S, len(layers)] bool
    prompts: int
    source: str = ""
    meta: dict = field(default_factory=dict)
    _thresholds: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def tokens(self) -> int:
        return int(self.p_exit.shape[0])

    @classmethod
    def count(cls, p_exit: dict[int, torch.Tensor], agree: dict[int, torch.Tensor], prompts: int,
              source: str = "", meta: dict | None = None, veto: dict[int, torch.Tensor] | None = None,
              lookup_veto: int | None = None) -> Calibration:
        """From each layer's exit probabilities p_exit[l] [S] and whether its candidate-local argmax
        is the full model's token agree[l] [S] (bool), over the same S tokens. veto[l] [S] (bool): where
        the engine will not let the token exit at l whatever its predictor says (the lookup veto,
        speculators.lookup_veto, with lookup n-grams of at least `lookup_veto` tokens): its p_exit is 0, so
        the thresholds are certified on the exits the engine can take, and meta["lookup_veto"] tells the
        engine to apply the same rule."""
        layers = sorted(p_exit)
        p = torch.stack([p_exit[l].float() for l in layers], 1)
        meta = dict(meta or {})
        if veto is not None:
            if lookup_veto is None:
                raise ValueError("a veto needs the lookup's shortest n-gram (lookup_veto)")
            p = p.masked_fill(torch.stack([veto[l].bool() for l in layers], 1), 0.0)
            meta["lookup_veto"] = int(lookup_veto)
        return cls(layers, p, torch.stack([agree[l].bool() for l in layers], 1), prompts, source, meta)

    @property
    def lookup_veto(self) -> int | None:
        """The shortest lookup n-gram whose token vetoes a contradicting exit (None: no veto): the rule the
        thresholds were certified under, which the engine applies with them."""
        n = self.meta.get("lookup_veto")
        return None if n is None else int(n)

    def exit_layers(self, thresholds: dict[int, float], num_layers: int) -> torch.Tensor:
        """[S] the layer each calibration token exits at under these thresholds (a layer missing from them
        never exits): the shallowest whose exit probability passes its threshold, num_layers where none does."""
        exit_at = torch.full((self.tokens,), num_layers)
        for c, l in reversed(list(enumerate(self.layers))):  # deepest first: a shallower exit overwrites
            if thresholds.get(l) is not None:
                exit_at = torch.where(self.p_exit[:, c] > thresholds[l], torch.tensor(l), exit_at)
        return exit_at

    def layer_counts(self, grid: tuple[float, ...] = THRESHOLD_GRID) -> dict[int, LayerCounts]:
        """Each layer on its own, over every token (the precision/recall curves of the report)."""
        out = {}
        for c, l in enumerate(self.layers):
            fired = [self.p_exit[:, c] > t for t in grid]
            bad = ~self.agree[:, c]
            out[l] = LayerCounts(list(grid), [int(f.sum()) for f in fired], [int((f & bad).sum()) for f in fired])
        return out

    def thresholds(self, eps: float, confidence: float = 0.95,
                   grid: tuple[float, ...] = THRESHOLD_GRID) -> dict[int, CalibratedLayer]:
        """Per layer: the lowest threshold certified at eps with confidence (see the module docstring),
        or threshold None (never exits). Layers are calibrated from the shallowest up, each on the
        tokens that no shallower layer let exit: at run time a deeper predictor sees only the tokens
        that did not exit below it, the harder ones. Cached per (eps, confidence, grid): Serve may ask
        for a tolerance on every request."""
        key = (eps, confidence, tuple(grid))
        if key not in self._thresholds:
            self._thresholds[key] = self._calibrate(eps, confidence, grid)
        return dict(self._thresholds[key])

    def _calibrate(self, eps: float, confidence: float, grid: tuple[float, ...]) -> dict[int, CalibratedLayer]:
        check_tolerance(eps, confidence)
        delta = (1 - confidence) / max(len(self.layers), 1)
        out = {}
        alive = torch.ones(self.tokens, dtype=torch.bool)
        for c, l in enumerate(self.layers):
            p, bad = self.p_exit[:, c], ~self.agree[:, c]
            chosen = None
            for t in grid:
                fired = alive & (p > t)
                n = int(fired.sum())
                if not testable(n, eps, delta):
                    continue
                k = int((fired & bad).sum())
                if p_value(k, n, eps) > delta:
                    break
                chosen = (t, n, k)
            if chosen is None:
                out[l] = CalibratedLayer(None, 0, 0, None)
                continue
            t, n, k = chosen
            out[l] = CalibratedLayer(t, n, k, upper_bound(k, n, delta))
            alive &= ~(p > t)
        return out

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        meta = {"layers": json.dumps(self.layers), "prompts": str(self.prompts), "source": self.source,
                "meta": json.dumps(self.meta)}
        save_file({"p_exit": self.p_exit.contiguous(), "agree": self.agree.to(torch.uint8).contiguous()}, str(path),
                  metadata=meta)

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        from safetensors import SafetensorError, safe_open

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"calibration not found: {path}")
        try:
            with safe_open(str(path), framework="pt") as f:
                md = f.metadata() or {}
                p_exit, agree = f.get_tensor("p_exit"), f.get_tensor("agree").bool()
            layers = json.loads(md["layers"])
            if p_exit.shape != agree.shape or p_exit.shape[1] != len(layers):
                raise ValueError(f"p_exit {tuple(p_exit.shape)}, agree {tuple(agree.shape)} for {len(layers)} layers")
            return cls(layers, p_exit, agree, int(md["prompts"]), md.get("source", ""), json.loads(md.get("meta", "{}")))
        except (SafetensorError, KeyError, ValueError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not a valid calibration file ({e})") from None


def testable(exits: int, eps: float, delta: float) -> bool:
    """Whether a threshold with this many exits enters the fixed sequence: only when half the
    tolerance observed would pass. Too few exits would end the sequence on noise before the
    thresholds that have the data; the rule reads the exit counts (the predictor's scores), never the
    disagreements, so the sequence is still fixed before the test looks at them."""
    return exits > 0 and p_value(int(exits * eps / 2), exits, eps) <= delta


@dataclass
class CalibratedLayer:
    threshold: float | None  # None: the layer never exits at this tolerance
    exits: int  # calibration tokens that exit at the threshold
    disagree: int  # of them, those the full model would not have emitted
    bound: float | None  # the Clopper-Pearson upper bound of the rate (Bonferroni level)


def calibrate_command(model_dir) -> str:
    """How to make calibration.safetensors for a model (the message of a tolerance asked without one)."""
    return (f"python -m jobs.train_predictors --model {model_dir} --prompts prompts/instructions_train.jsonl "
            f"--calib-prompts 250")
