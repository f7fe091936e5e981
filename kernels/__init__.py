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

__all__ = [
    "BACKENDS",
    "triton_mode",
    "cand_logits_forward",
    "fused_predictor",
    "fused_predictor_reference",
    "predictor_forward",
    "rmsnorm_cand_logits",
    "rmsnorm_cand_logits_reference",
]
