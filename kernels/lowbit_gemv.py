"""Low-bit GEMV / small GEMM on CUDA: y[B, O] = x[B, I] @ dequant(W)[O, I]^T, each weight tile read
once per program and dequantized in registers, beside its plain-torch reference.

Weight planes (specee_core.model.quant.QuantWeight, llama.cpp's blocks of 32 along I):
    q4 (Q4_1): qs uint8 [O, I/2]: block g's element j < 16 is the low nibble of byte 16g + j,
               element j + 16 its high nibble; d, m fp16 [O, I/32]; w = d * q + m
    q8 (Q8_0): qs int8 [O, I]; d fp16 [O, I/32]; w = d * q

One program per (BLOCK_O output rows, BLOCK_B activation rows): it walks I in tiles of BLOCK_K
(whole blocks), dequantizes the [BLOCK_O, BLOCK_K] weight tile and accumulates
x_tile @ w_tile^T with tl.dot in full fp32 (input_precision "ieee": no TF32 rounding). Decode batches
(B <= 16) are one row tile, so every weight is read once per call.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.predictor import _check_launchable, _triton_jit, tl, triton
from kernels.reference_math import QK, dequantize_reference

BLOCK_B = 16  # activation rows per program (tl.dot needs >= 16)
BLOCK_O = 32  # output rows per program
BLOCK_K = 64  # input columns per step: two blocks


@_triton_jit
def _lowbit_gemv_kernel(
    x_ptr,  # [B, I] fp32
    qs_ptr,  # q4: uint8 [O, I/2]; q8: int8 [O, I]
    d_ptr,  # fp16 [O, I/32]
    m_ptr,  # fp16 [O, I/32] (q4); unused for q8
    y_ptr,  # [B, O] fp32
    B, I, O,
    Q4: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_O: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_o = tl.program_id(0)
    pid_b = tl.program_id(1)
    offs_o = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)  # [BLOCK_O]
    offs_b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)  # [BLOCK_B]
    mask_o = offs_o < O
    mask_b = offs_b < B
    G = I // 32
    acc = tl.zeros((BLOCK_B, BLOCK_O), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K] input columns
        mask_k = offs_k < I
        g = offs_k // 32  # block of each column
        j = offs_k % 32  # position inside the block
        wmask = mask_o[:, None] & mask_k[None, :]
        sc = offs_o[:, None] * G + g[None, :]  # [BLOCK_O, BLOCK_K] index into d (and m)
        d = tl.load(d_ptr + sc, mask=wmask, other=0.0).to(tl.float32)
        if Q4:
            byte = tl.load(qs_ptr + offs_o[:, None] * (I // 2) + (g * 16 + j % 16)[None, :], mask=wmask, other=0)
            q = ((byte.to(tl.int32) >> ((j // 16) * 4)[None, :]) & 0xF).to(tl.float32)
            m = tl.load(m_ptr + sc, mask=wmask, other=0.0).to(tl.float32)
            w = q * d + m  # [BLOCK_O, BLOCK_K]
        else:
            q = tl.load(qs_ptr + offs_o[:, None] * I + offs_k[None, :], mask=wmask, other=0).to(tl.float32)
            w = q * d
        x = tl.load(x_ptr + offs_b[:, None] * I + offs_k[None, :], mask=mask_b[:, None] & mask_k[None, :],
                    other=0.0)  # [BLOCK_B, BLOCK_K]
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    tl.store(y_ptr + offs_b[:, None] * O + offs_o[None, :], acc, mask=mask_b[:, None] & mask_o[None, :])


def _check(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> tuple[int, int, int]:
    """Checks the planes against x [B, I] (fp32); returns (B, I, O)."""
    if x.dim() != 2 or x.dtype != torch.float32:
        raise ValueError(f"x must be fp32 [B, I], got {x.dtype} {tuple(x.shape)}")
    b, i = x.shape
    if i % QK:
        raise ValueError(f"in_features {i} is not a multiple of {QK}")
    q4 = m is not None
    per_row = i // 2 if q4 else i
    want = torch.uint8 if q4 else torch.int8
    if qs.dim() != 2 or qs.shape[1] != per_row or qs.dtype != want:
        raise ValueError(f"qs must be {want} [O, {per_row}], got {qs.dtype} {tuple(qs.shape)}")
    o = qs.shape[0]
    for name, t in (("d", d), ("m", m)):
        if t is not None and (t.dtype != torch.float16 or tuple(t.shape) != (o, i // QK)):
            raise ValueError(f"{name} must be fp16 [{o}, {i // QK}], got {t.dtype} {tuple(t.shape)}")
    return b, i, o


def lowbit_linear(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """x [B, I] fp32 @ dequant(W)^T -> [B, O] fp32 on CUDA (or CPU tensors under TRITON_INTERPRET=1)."""
    b, i, o = _check(x, qs, d, m)
    named = {"x": x, "qs": qs, "d": d, **({"m": m} if m is not None else {})}
    _check_launchable(named)
    y = torch.empty(b, o, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(o, BLOCK_O), triton.cdiv(b, BLOCK_B))
    _lowbit_gemv_kernel[grid](x, qs, d, d if m is None else m, y, b, i, o, Q4=m is not None,
                              BLOCK_B=BLOCK_B, BLOCK_O=BLOCK_O, BLOCK_K=BLOCK_K)
    return y


def lowbit_linear_reference(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """The same product in plain torch: dequantize_reference, then F.linear in fp32."""
    _check(x, qs, d, m)
    return F.linear(x, dequantize_reference(qs, d, m))
