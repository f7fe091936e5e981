"""The plain-torch math that the kernels' references and the engine share, defined once, importing torch
only (no triton): the exit predictor's features and MLP (SpecEE T1) and the low-bit weights'
dequantization. kernels.predictor and kernels.lowbit_gemv test their kernels against references built on
these; specee_core.early_exit.predictors and specee_core.model.quant import them."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

QK = 32  # low-bit weights per block (llama.cpp's Q4_1 / Q8_0)


@dataclass
class LayerPredictor:
    """One layer's exit MLP: Linear(F, H) -> ReLU -> Linear(H, 1) (H = 512; F = 3K or 4K, by the feature set)."""
    w1: torch.Tensor  # [H, F]
    b1: torch.Tensor  # [H]
    w2: torch.Tensor  # [1, H]
    b2: torch.Tensor  # [1]


# The predictor's math (SpecEE T1): the engine's CPU scorer (specee_core.early_exit.predictors), the
# fused kernel's torch reference (kernels.predictor, which the Triton kernel is tested against) and the
# training data all call these.


def candidate_probs(z: torch.Tensor) -> torch.Tensor:
    """p [N, K] fp32 = softmax over the K candidate logits z [N, K]."""
    return z.float().softmax(-1)


def predictor_features(z: torch.Tensor, prev_prob: torch.Tensor, draft_prob: torch.Tensor | None = None,
                       record: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidate logits z [N, K] and the probabilities prev_prob [N, K] at the row's previous
    evaluated layer (zeros at the first) -> (features [N, 3K] = [z, p, p - prev_prob], p [N, K]), fp32;
    with the draft's probabilities of its candidates draft_prob [N, K]: features [N, 4K] = [..., draft_prob];
    and its record [N, K] (DraftRecord.features): [N, 5K] = [..., draft_prob, record]."""
    z = z.float()
    p = candidate_probs(z)
    extra = tuple(t.float() for t in (draft_prob, record) if t is not None)
    return torch.cat((z, p, p - prev_prob.float()) + extra, dim=-1), p


def exit_logit(x: torch.Tensor, pred: LayerPredictor) -> torch.Tensor:
    """The exit MLP on features x [N, 3K] -> logits [N] (training takes these, BCE with logits)."""
    return F.linear(torch.relu(F.linear(x, pred.w1, pred.b1)), pred.w2, pred.b2).squeeze(-1)


def exit_probability(x: torch.Tensor, pred: LayerPredictor) -> torch.Tensor:
    """p_exit [N] = sigmoid(exit_logit(x, pred)) for features x [N, 3K]."""
    return torch.sigmoid(exit_logit(x, pred))


def dequantize_reference(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """Weight planes -> fp32 [O, I], computed as gguf's numpy reference does: (d * q) + m, rounded in that
    order. q8: qs [O, I] int8; q4 (m given): qs [O, I / 2] uint8, low nibbles first within a block."""
    o, g = d.shape
    i = g * QK
    scale = d.float()[..., None]  # [O, G, 1]
    if m is None:
        return (qs.view(o, g, QK).float() * scale).reshape(o, i)
    packed = qs.view(o, g, QK // 2)
    q = torch.cat((packed & 0x0F, packed >> 4), dim=-1).float()  # [O, G, 32]
    return (q * scale + m.float()[..., None]).reshape(o, i)


# The int8-activation kernels' math (kernels/lowbit_cpu.cpp: quantize_rows_i8, q4_linear_i8, q8_linear_i8):
# llama.cpp's Q8_1 on the activations, its scales kept in fp32. Every fp32 operation below is done in
# float64 and rounded to fp32 (exactly fp32's own correctly rounded result), so the kernel's qx, dx, sx
# equal these bit for bit.


def quantize_activations_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [B, I] (fp32, or bf16 taken as fp32) -> (qx int8 [B, I], dx fp32 [B, I/32], sx fp32 [B, I/32]), per
    block of 32 as ggml's quantize_row_q8_1_ref: dx = amax / 127, qx = round(x * (1 / dx)) with halves away
    from zero (C's roundf, not torch.round's halves to even), sx = dx * sum(qx). A block of zeros has
    dx = 0 and qx = 0 (the inverse is taken as 0, never a division by zero)."""
    b, i = x.shape
    if i % QK:
        raise ValueError(f"x has {i} columns; expected a multiple of {QK}")
    xb = x.float().reshape(b, i // QK, QK).double()
    f32 = lambda t: t.float().double()  # noqa: E731 -- round a float64 result to fp32
    amax = xb.abs().amax(-1)  # [B, G], exact
    dx = f32(amax / 127)
    inv = f32(torch.where(dx != 0, 1 / dx.clamp_min(1e-45), torch.zeros_like(dx)))
    v = f32(xb * inv[..., None])  # [B, G, 32]
    q = torch.sign(v) * torch.floor(v.abs() + 0.5)  # roundf; exact in float64 for |v| <= 127.5
    sx = f32(dx * q.sum(-1))
    return q.to(torch.int8).reshape(b, i), dx.float(), sx.float()


def lowbit_linear_i8_reference(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor,
                               m: torch.Tensor | None) -> torch.Tensor:
    """y [B, O] fp32 = x [B, I] quantized per block (quantize_activations_reference) dotted with the weight
    planes (dequantize_reference's formats), per block: d * dx * sum(q_w * q_x) + m * sx (q4), or
    d * dx * sum(q_w * q_x) (q8, m None). The integer sums are exact (float64 products of small
    integers); the scaling and the sum over blocks are float64, rounded to fp32 once at the end."""
    qx, dx, sx = quantize_activations_reference(x)
    o, g = d.shape
    b = x.shape[0]
    if m is None:
        qw = qs.view(o, g, QK).double()
    else:
        packed = qs.view(o, g, QK // 2)
        qw = torch.cat((packed & 0x0F, packed >> 4), dim=-1).double()  # [O, G, 32]
    isum = torch.bmm(qx.view(b, g, QK).double().transpose(0, 1), qw.permute(1, 2, 0))  # [G, B, O], exact
    y = torch.einsum("gbo,og,bg->bo", isum, d.double(), dx.double())
    if m is not None:
        y = y + sx.double() @ m.double().T
    return y.float()
