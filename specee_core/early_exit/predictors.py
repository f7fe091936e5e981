"""Per-layer exit predictors (SpecEE T1): features from the k candidate rows of the LM head,
a 2-layer MLP per layer, stored together in one safetensors file with JSON metadata."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

HIDDEN = 512


@dataclass
class LayerPredictor:
    """One layer's exit MLP: Linear(3K, H) -> ReLU -> Linear(H, 1) (H = 512)."""
    w1: torch.Tensor  # [H, 3K]
    b1: torch.Tensor  # [H]
    w2: torch.Tensor  # [1, H]
    b2: torch.Tensor  # [1]


# The predictor's math (SpecEE T1), defined once: the engine's CPU scorer, the kernel's torch
# reference (kernels.predictor, which the fused Triton kernel is tested against) and the
# training data all call these.


def candidate_probs(z: torch.Tensor) -> torch.Tensor:
    """p [N, K] fp32 = softmax over the K candidate logits z [N, K]."""
    return z.float().softmax(-1)


def predictor_features(z: torch.Tensor, prev_prob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidate logits z [N, K] and the probabilities prev_prob [N, K] at the row's previous
    evaluated layer (zeros at the first) -> (features [N, 3K] = [z, p, p - prev_prob], p [N, K]), fp32."""
    z = z.float()
    p = candidate_probs(z)
    return torch.cat((z, p, p - prev_prob.float()), dim=-1), p


def exit_logit(x: torch.Tensor, pred: LayerPredictor) -> torch.Tensor:
    """The exit MLP on features x [N, 3K] -> logits [N] (training takes these, BCE with logits)."""
    return F.linear(torch.relu(F.linear(x, pred.w1, pred.b1)), pred.w2, pred.b2).squeeze(-1)


def exit_probability(x: torch.Tensor, pred: LayerPredictor) -> torch.Tensor:
    """p_exit [N] = sigmoid(exit_logit(x, pred)) for features x [N, 3K]."""
    return torch.sigmoid(exit_logit(x, pred))


class ExitMLP(nn.Module):
    """A trainable LayerPredictor; forward gives logits (exit_logit), the sigmoid is the caller's."""

    def __init__(self, k: int, hidden: int = HIDDEN):
        super().__init__()
        self.fc1 = nn.Linear(3 * k, hidden)
        self.fc2 = nn.Linear(hidden, 1)

    def weights(self) -> LayerPredictor:
        """The parameters themselves (gradients flow through them)."""
        return LayerPredictor(self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return exit_logit(x, self.weights())


class PredictorBank:
    """Predictors by 1-based layer. `k`: candidates per row the predictors were trained for."""

    def __init__(self, k: int, layers: dict[int, LayerPredictor], meta: dict | None = None):
        self.k = k
        self.layers = layers
        self.meta = meta or {}

    @classmethod
    def from_mlps(cls, k: int, mlps: dict[int, ExitMLP], meta: dict | None = None) -> PredictorBank:
        layers = {l: LayerPredictor(m.fc1.weight.detach(), m.fc1.bias.detach(), m.fc2.weight.detach(),
                                    m.fc2.bias.detach()) for l, m in mlps.items()}
        return cls(k, layers, meta)

    def to(self, device) -> PredictorBank:
        mv = lambda t: t.to(device=device, dtype=torch.float32).contiguous()  # noqa: E731
        return PredictorBank(self.k, {l: LayerPredictor(mv(p.w1), mv(p.b1), mv(p.w2), mv(p.b2))
                                      for l, p in self.layers.items()}, self.meta)

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        tensors = {}
        for l, p in self.layers.items():
            for name in ("w1", "b1", "w2", "b2"):
                tensors[f"layer.{l}.{name}"] = getattr(p, name).contiguous().float()
        meta = {"k": str(self.k), "layers": json.dumps(sorted(self.layers)), "meta": json.dumps(self.meta)}
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
            layers = {}
            for l in json.loads(md["layers"]):
                t = {n: f.get_tensor(f"layer.{l}.{n}") for n in ("w1", "b1", "w2", "b2")}
                if t["w1"].shape[1] != 3 * k:
                    raise ValueError(f"{path}: layer {l} w1 has shape {tuple(t['w1'].shape)}, expected [H, {3 * k}]")
                layers[int(l)] = LayerPredictor(**t)
        return cls(k, layers, json.loads(md.get("meta", "{}")))


def train_layer(x: torch.Tensor, y: torch.Tensor, k: int, epochs: int = 100, batch: int = 1024, lr: float = 1e-3,
                seed: int = 0) -> ExitMLP:
    """BCE training of one layer's predictor on features x [S, 3K], labels y [S] in {0, 1}."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    mlp = ExitMLP(k)
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
