"""Per-layer exit predictors (SpecEE T1): features from the k candidate rows of the LM head,
a 2-layer MLP per layer, stored together in one safetensors file with JSON metadata.

Two feature sets (the file's metadata says which):
- "zpd" (the paper's, 3K): the candidates' logits z at the layer, their softmax p, and p's shift
  from the layer below;
- "zpdq" (4K): the same and q, the draft head's own probabilities of its candidates. At a middle
  layer of a small model the candidates' ranking is close to chance; a confident draft says which
  candidate is likely right, and the layer's ranking agreeing with it is what makes an exit safe
  (on SmolLM2-135M the exits the quality contract certifies come almost only from such tokens);
- "zpdqh" (5K): the same and the draft's recent record (DraftRecord): whether its top candidate was the
  row's token one and two steps back and its hit rate over the last four, zero-padded to K. The draft
  is right in runs (on SmolLM2, at layer 1 and threshold 0.9, exits disagree on 2.3% of tokens after a
  hit and 6.3% after a miss).

What an exit emits (the file's metadata "exit_token"; the predictors learn whether that token is the full
model's):
- "local" (the paper's): the argmax among the K candidates of the layer's own logits;
- "draft": the draft head's top candidate. At layers 1-18 of SmolLM2-135M the layer's own ranking of
  the candidates picks the full model's token for ~25% of tokens (chance among 4), the draft's top one
  for 57%; the layer's logits then say whether the draft is right rather than which candidate is.
  Measured on SmolLM2's held-out calibration tokens at the same tolerance: layers run 87% instead of
  95% at eps 0.05."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from kernels.reference_math import (LayerPredictor, candidate_probs, exit_logit,  # noqa: F401 -- the math, one definition
                               exit_probability, predictor_features)

log = logging.getLogger(__name__)

HIDDEN = 512


FEATURE_SETS = {"zpd": 3, "zpdq": 4, "zpdqh": 5}  # feature set -> feature width in units of K
RECORD_SPAN = 4  # DraftRecord: the proposals a row's record looks back over
EXIT_TOKENS = ("local", "draft")  # what an exit emits (module docstring)


class DraftRecord:
    """Per batch row, whether the speculator's top candidate was the token the row went on with, over
    its last RECORD_SPAN proposals (feature set "zpdqh"). The steppers call step once per proposal (it
    observes the tokens fed, the previous step's outcome, and notes the new candidates), and clear for
    rows whose proposals stopped (dense steps, a new prompt): such a row starts over, as at its first step."""

    def __init__(self, rows: int):
        self.hits: list[list[bool]] = [[] for _ in range(rows)]
        self.top: list[int | None] = [None] * rows

    def clear(self, rows: list[int]) -> None:
        for b in rows:
            self.hits[b], self.top[b] = [], None

    def observe(self, rows: list[int], tokens: list[int]) -> None:
        """tokens[r]: the token row rows[r] went on with after its last proposal."""
        for b, t in zip(rows, tokens):
            if self.top[b] is not None:
                self.hits[b] = (self.hits[b] + [self.top[b] == t])[-RECORD_SPAN:]
                self.top[b] = None

    def proposed(self, rows: list[int], cand: torch.Tensor) -> None:
        """cand [N, K]: the candidates just proposed for the rows, best first."""
        for b, t in zip(rows, cand[:, 0].tolist()):
            self.top[b] = int(t)

    def step(self, rows: list[int], tokens: list[int], cand: torch.Tensor) -> torch.Tensor:
        """One proposal step: observe the tokens fed, then the record the predictors read [N, K], then
        note the new candidates cand [N, K]."""
        self.observe(rows, tokens)
        out = self.features(rows, cand.shape[1])
        self.proposed(rows, cand)
        return out

    def features(self, rows: list[int], k: int) -> torch.Tensor:
        """[N, K] fp32: the last outcome, the one before, the hit rate over the last RECORD_SPAN (0 where
        none), zero-padded to K (K >= 3)."""
        if k < 3:
            raise ValueError(f"the draft's record needs k >= 3 candidates, got {k}")
        out = torch.zeros(len(rows), k)
        for r, b in enumerate(rows):
            h = self.hits[b]
            if h:
                out[r, 0] = float(h[-1])
                out[r, 1] = float(h[-2]) if len(h) > 1 else 0.0
                out[r, 2] = sum(h) / len(h)
        return out


def exit_choice(z: torch.Tensor, cand: torch.Tensor, exit_token: str) -> torch.Tensor:
    """The token an exit emits from candidate logits z [..., K] of candidates cand [N, K] (z [N, K] or
    [N, L-1, K], one row per layer): "local" the argmax of z among the candidates, "draft" the draft's
    top candidate cand[:, 0]. Token ids [N] or [N, L-1]."""
    if exit_token == "draft":
        return cand[:, :1].expand(z.shape[:-1]) if z.dim() == 3 else cand[:, 0]
    if exit_token != "local":
        raise ValueError(f"exit_token must be one of {EXIT_TOKENS}, got {exit_token!r}")
    idx = z.argmax(-1)
    return cand.gather(1, idx) if z.dim() == 3 else cand.gather(1, idx[:, None]).squeeze(1)


class ExitMLP(nn.Module):
    """A trainable LayerPredictor over `width` features; forward gives logits (exit_logit), the sigmoid
    is the caller's."""

    def __init__(self, width: int, hidden: int = HIDDEN):
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, 1)

    def weights(self) -> LayerPredictor:
        """The parameters themselves (gradients flow through them)."""
        return LayerPredictor(self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return exit_logit(x, self.weights())


class PredictorBank:
    """Predictors by 1-based layer. `k`: candidates per row the predictors were trained for;
    `features`: their feature set (FEATURE_SETS; "zpdq" needs a speculator that scores its candidates);
    `exit_token`: what an exit emits, the token the predictors learnt to trust (EXIT_TOKENS)."""

    def __init__(self, k: int, layers: dict[int, LayerPredictor], meta: dict | None = None, features: str = "zpd",
                 exit_token: str = "local"):
        if features not in FEATURE_SETS:
            raise ValueError(f"features must be one of {sorted(FEATURE_SETS)}, got {features!r}")
        if exit_token not in EXIT_TOKENS:
            raise ValueError(f"exit_token must be one of {EXIT_TOKENS}, got {exit_token!r}")
        self.k = k
        self.layers = layers
        self.meta = meta or {}
        self.features = features
        self.exit_token = exit_token

    @property
    def width(self) -> int:
        """The predictors' input width."""
        return FEATURE_SETS[self.features] * self.k

    @property
    def reads_draft_prob(self) -> bool:
        """Whether the features include the speculator's probabilities of its candidates."""
        return self.features in ("zpdq", "zpdqh")

    @property
    def reads_record(self) -> bool:
        """Whether the features include the draft's recent record (DraftRecord)."""
        return self.features == "zpdqh"

    @classmethod
    def from_mlps(cls, k: int, mlps: dict[int, ExitMLP], meta: dict | None = None,
                  features: str = "zpd", exit_token: str = "local") -> PredictorBank:
        layers = {l: LayerPredictor(m.fc1.weight.detach(), m.fc1.bias.detach(), m.fc2.weight.detach(),
                                    m.fc2.bias.detach()) for l, m in mlps.items()}
        return cls(k, layers, meta, features, exit_token)

    def to(self, device) -> PredictorBank:
        mv = lambda t: t.to(device=device, dtype=torch.float32).contiguous()  # noqa: E731
        return PredictorBank(self.k, {l: LayerPredictor(mv(p.w1), mv(p.b1), mv(p.w2), mv(p.b2))
                                      for l, p in self.layers.items()}, self.meta, self.features, self.exit_token)

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        tensors = {}
        for l, p in self.layers.items():
            for name in ("w1", "b1", "w2", "b2"):
                tensors[f"layer.{l}.{name}"] = getattr(p, name).contiguous().float()
        meta = {"k": str(self.k), "layers": json.dumps(sorted(self.layers)), "meta": json.dumps(self.meta),
                "features": self.features, "exit_token": self.exit_token}
        save_file(tensors, str(path), metadata=meta)

    @classmethod
    def load(cls, path: str | Path) -> PredictorBank:
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"predictors not found: {path}")
        with safe_open(str(path), framework="pt") as f:
            md = f.metadata() or {}
            if "k" not in md or "layers" not in md:
                raise ValueError(f"{path}: predictor file without 'k'/'layers' metadata")
            k = int(md["k"])
            features = md.get("features", "zpd")  # files from before the draft's confidence: the paper's set
            if features not in FEATURE_SETS:
                raise ValueError(f"{path}: unknown feature set {features!r} (known: {sorted(FEATURE_SETS)})")
            exit_token = md.get("exit_token", "local")  # files from before the choice: the paper's
            if exit_token not in EXIT_TOKENS:
                raise ValueError(f"{path}: unknown exit_token {exit_token!r} (known: {EXIT_TOKENS})")
            width = FEATURE_SETS[features] * k
            layers = {}
            for l in json.loads(md["layers"]):
                t = {n: f.get_tensor(f"layer.{l}.{n}") for n in ("w1", "b1", "w2", "b2")}
                if t["w1"].shape[1] != width:
                    raise ValueError(f"{path}: layer {l} w1 has shape {tuple(t['w1'].shape)}, expected [H, {width}] "
                                     f"for feature set {features!r}")
                layers[int(l)] = LayerPredictor(**t)
        return cls(k, layers, json.loads(md.get("meta", "{}")), features, exit_token)


def train_layer(x: torch.Tensor, y: torch.Tensor, epochs: int = 100, batch: int = 1024, lr: float = 1e-3,
                seed: int = 0) -> ExitMLP:
    """BCE training of one layer's predictor on features x [S, F], labels y [S] in {0, 1}."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    mlp = ExitMLP(x.shape[1])
    opt = torch.optim.Adam(mlp.parameters(), lr=lr)
    n = len(x)
    for _ in range(epochs):
        order = torch.randperm(n, generator=g)
        for s in range(0, n, batch):
            i = order[s : s + batch]
            loss = nn.functional.binary_cross_entropy_with_logits(mlp(x[i]), y[i])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return mlp.eval().requires_grad_(False)


def classification_report(mlp: ExitMLP, x: torch.Tensor, y: torch.Tensor, threshold: float = 0.5) -> dict:
    with torch.no_grad():
        pred = exit_probability(x, mlp.weights()) > threshold
    pos = y > 0.5
    tp = (pred & pos).sum().item()
    return {"samples": len(y), "positive_rate": pos.float().mean().item(),
            "predicted_rate": pred.float().mean().item(),
            "precision": tp / max(pred.sum().item(), 1), "recall": tp / max(pos.sum().item(), 1)}
