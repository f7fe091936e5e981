"""kernels.lowbit_gemv: the Triton low-bit GEMV against its plain-torch reference (in the interpreter on
CPU; compiled on CUDA), random and real shapes, odd sizes, batch 1 and 16, q4 and q8; argument checks.
See tests/kernels/test_predictor.py for why TRITON_INTERPRET is set before the import."""
from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels import triton_mode  # noqa: E402
from kernels.lowbit_gemv import lowbit_linear, lowbit_linear_reference  # noqa: E402
from specee_core.model.quant import quantize  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
needs_kernel = pytest.mark.skipif(not (triton_mode() == "interpreter" or (HAS_CUDA and triton_mode() == "compiled")),
                                  reason=f"triton mode {triton_mode()!r} without CUDA: run with TRITON_INTERPRET=1")


def planes(o: int, i: int, fmt: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    qw = quantize(torch.randn(o, i, generator=g) * 0.05, fmt)
    return [None if t is None else t.to(DEVICE) for t in (qw.qs, qw.d, qw.m)]


@needs_kernel
@pytest.mark.parametrize("fmt", ["q4", "q8"])
@pytest.mark.parametrize("b,o,i", [(1, 37, 96), (16, 64, 576), (3, 130, 160), (17, 40, 64)] +
                         ([(1, 49152, 576), (16, 3072, 576), (4, 576, 1536)] if HAS_CUDA else []))
def test_kernel_equals_reference(fmt, b, o, i):
    qs, d, m = planes(o, i, fmt, seed=b)
    x = torch.randn(b, i, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    torch.testing.assert_close(lowbit_linear(x, qs, d, m), lowbit_linear_reference(x, qs, d, m), rtol=1e-5, atol=1e-5)


def test_bad_arguments_are_errors_naming_them():
    qs, d, m = planes(8, 64, "q4")
    with pytest.raises(ValueError, match="x must be fp32"):
        lowbit_linear_reference(torch.zeros(1, 64, dtype=torch.float16, device=DEVICE), qs, d, m)
    with pytest.raises(ValueError, match="not a multiple of 32"):
        lowbit_linear_reference(torch.zeros(1, 40, device=DEVICE), qs, d, m)
    with pytest.raises(ValueError, match="qs must be torch.int8"):
        lowbit_linear_reference(torch.zeros(1, 64, device=DEVICE), qs, d, None)
    with pytest.raises(ValueError, match="m must be fp16"):
        lowbit_linear_reference(torch.zeros(1, 64, device=DEVICE), qs, d, m.float())
