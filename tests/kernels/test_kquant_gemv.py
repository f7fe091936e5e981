"""kernels.kquant_gemv: the Triton GEMV for GGUF's block formats against ggml_blocks' plain-torch reference (in the
interpreter on CPU; compiled on CUDA): every format, random blocks and the blocks gguf's quantizer writes, 1, 3 and
17 activation rows, an output dim across two row tiles, one and several blocks along I (a half tile for the
formats of 32); its weights equal the reference's bit for bit; argument checks; QuantLinear's CUDA path.
See tests/kernels/test_predictor.py for why TRITON_INTERPRET is set before the import."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels import triton_mode  # noqa: E402
from kernels.ggml_blocks import (BLOCK_FORMATS, blocks_linear_reference, dequantize_blocks_reference,  # noqa: E402
                                 random_blocks)
from kernels.kquant_gemv import blocks_linear  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
needs_kernel = pytest.mark.skipif(not (triton_mode() == "interpreter" or (HAS_CUDA and triton_mode() == "compiled")),
                                  reason=f"triton mode {triton_mode()!r} without CUDA: run with TRITON_INTERPRET=1")

FORMATS = tuple(BLOCK_FORMATS)
# in_features per block size: one block, an odd count (a half-empty tile of 64 for blocks of 32), several
IN_FEATURES = {32: (32, 96, 512), 256: (256, 512)}
CASES = [(fmt, b, i) for fmt in FORMATS for b in (1, 3, 17) for i in IN_FEATURES[BLOCK_FORMATS[fmt][0]]]


def blocks(o: int, i: int, fmt: str, seed: int = 0) -> torch.Tensor:
    return random_blocks(o, i, fmt, torch.Generator().manual_seed(seed)).to(DEVICE)


def activations(b: int, i: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(b, i, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def assert_matches_reference(x: torch.Tensor, raw: torch.Tensor, fmt: str) -> None:
    ref = blocks_linear_reference(x, raw, fmt)
    assert ref.abs().max() > 0.1  # the blocks are not all zero
    torch.testing.assert_close(blocks_linear(x, raw, fmt), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@needs_kernel
@pytest.mark.parametrize("fmt,b,i", CASES, ids=[f"{f}-b{b}-i{i}" for f, b, i in CASES])
def test_kernel_equals_reference_on_random_blocks(fmt, b, i):
    """37 output rows: a full tile of 32 and a ragged one; 17 activation rows: a full tile of 16 and one row."""
    assert_matches_reference(activations(b, i), blocks(37, i, fmt, seed=b), fmt)


@needs_kernel
@pytest.mark.parametrize("fmt", ["q4_0", "q5_0", "q5_1"])
def test_kernel_equals_reference_on_ggufs_own_blocks(fmt):
    """Blocks gguf's quantizer writes (it has none for the K-quants), not only random bytes."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    w = np.random.default_rng(0).standard_normal((37, 256)).astype(np.float32) * 0.05
    raw = torch.from_numpy(quantize(w, GGMLQuantizationType[fmt.upper()])).to(DEVICE)
    assert_matches_reference(activations(3, 256), raw, fmt)


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
def test_kernels_weights_equal_the_references_bit_for_bit(fmt):
    """x = the identity: each output is one weight times 1 plus zeros, exact in fp32, so y^T is the kernel's
    dequantized weights, which must equal the reference's (and so gguf's) bit for bit."""
    n = BLOCK_FORMATS[fmt][0]
    i = max(n, 64)
    raw = blocks(37, i, fmt)
    eye = torch.eye(i, device=DEVICE)
    assert torch.equal(blocks_linear(eye, raw, fmt).T, dequantize_blocks_reference(raw, fmt))


def test_bad_arguments_are_errors_naming_them():
    raw = blocks(4, 256, "q4_k")
    x = torch.zeros(2, 256, device=DEVICE)
    with pytest.raises(ValueError, match="fmt 'q3_k'"):
        blocks_linear(x, raw, "q3_k")
    with pytest.raises(ValueError, match="x must be fp32"):
        blocks_linear(x.half(), raw, "q4_k")
    with pytest.raises(ValueError, match="in_features 96 is not a multiple of q4_k's block of 256"):
        blocks_linear(torch.zeros(2, 96, device=DEVICE), raw, "q4_k")
    with pytest.raises(ValueError, match=r"raw must be uint8 \[O, 288\]"):
        blocks_linear(torch.zeros(2, 512, device=DEVICE), raw, "q4_k")
    with pytest.raises(ValueError, match="raw must be uint8"):
        blocks_linear(x, raw.view(torch.int8), "q4_k")


@needs_kernel
def test_strided_blocks_are_an_error_naming_them():
    raw = blocks(4, 32, "q4_0")  # [4, 18]
    strided = raw.t().contiguous().t()
    with pytest.raises(ValueError, match="raw is not contiguous"):
        blocks_linear(torch.zeros(1, 32, device=DEVICE), strided, "q4_0")


@pytest.mark.skipif(not HAS_CUDA or triton_mode() != "compiled", reason="QuantLinear takes this kernel on CUDA only")
@pytest.mark.parametrize("fmt", FORMATS)
def test_quant_linear_takes_the_kernel_on_cuda_for_few_rows(fmt):
    from specee_core.model.quant import QuantLinear, QuantWeight

    raw = blocks(96, 512, fmt)
    lin = QuantLinear(QuantWeight(fmt, raw))
    few, many = activations(3, 512), activations(256, 512)
    assert not lin.dense_from(3) and lin.dense_from(256)
    assert torch.equal(lin(few), blocks_linear(few, raw, fmt))
    for x in (few, many):
        ref = blocks_linear_reference(x, raw, fmt)
        torch.testing.assert_close(lin(x), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
