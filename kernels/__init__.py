"""Triton kernels, one op per file, each beside a plain-torch reference with the same signature.

Importing this package never needs triton: the references run on torch alone.
"""
from kernels.predictor import (
    BACKENDS,
    triton_mode,
    cand_logits_forward,
    fused_predictor,
    fused_predictor_reference,
    predictor_forward,
    rmsnorm_cand_logits,
    rmsnorm_cand_logits_reference,
)

from kernels.lowbit_gemv import lowbit_linear, lowbit_linear_reference

__all__ = [
    "lowbit_linear",
    "lowbit_linear_reference",
    "BACKENDS",
    "triton_mode",
    "cand_logits_forward",
    "fused_predictor",
    "fused_predictor_reference",
    "predictor_forward",
    "rmsnorm_cand_logits",
    "rmsnorm_cand_logits_reference",
]
