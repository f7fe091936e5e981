"""GGUF block-format GEMV / small GEMM on CUDA: y[B, O] = x[B, I] @ dequant(W)[O, I]^T, W in a GGUF file's own
blocks (q4_k, q5_k, q6_k, q4_0, q5_0, q5_1; kernels/ggml_blocks.py spells out each layout), each weight tile read
once per program and dequantized in registers. Its reference is ggml_blocks.blocks_linear_reference (same signature).

    raw uint8 [O, I / n * bytes]: row o is its I / n blocks of n weights (n = 32 or 256), `bytes` bytes each,
    the fp16 scales inside the blocks, exactly as the file stores them

One program per (BLOCK_O output rows, BLOCK_B activation rows), as kernels/lowbit_gemv.py: it walks I in tiles of
BLOCK_K columns (two blocks of 32, or two 32-weight sub-blocks of a super-block), finds each column's block and its
place in it, gathers the bytes it needs (the fp16 scales as two bytes joined and bitcast), forms the [BLOCK_O,
BLOCK_K] weight tile with the reference's fp32 roundings (a product, then the minimum added or subtracted, rounded
apart: launched with enable_fp_fusion=False, so the compiler does not contract the two into an FMA) and accumulates
x_tile @ w_tile^T with tl.dot in full fp32 (input_precision "ieee"). The weights equal the reference's bit for bit;
only the sum's order differs.
"""
from __future__ import annotations

import torch

from kernels.ggml_blocks import BLOCK_FORMATS, row_bytes
from kernels.predictor import _check_launchable, _triton_jit, tl, triton

BLOCK_B = 16  # activation rows per program (tl.dot needs >= 16)
BLOCK_O = 32  # output rows per program
BLOCK_K = 64  # input columns per step: two blocks of 32 / two sub-blocks of a super-block


@_triton_jit
def _half(blk, at, mask):
    """The fp16 at byte offset `at` of each block (blk: [BLOCK_O, BLOCK_K] pointers to the blocks) -> fp32."""
    lo = tl.load(blk + at, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(blk + at + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@_triton_jit
def _byte(blk, at, mask):
    """The byte at offset `at` of each block -> int32."""
    return tl.load(blk + at, mask=mask, other=0).to(tl.int32)


@_triton_jit
def _dequant_tile(blk, p, mask, FMT: tl.constexpr):
    """blk [BLOCK_O, BLOCK_K] pointers to each weight's block, p [1, BLOCK_K] its place in the block -> fp32 weights
    [BLOCK_O, BLOCK_K], with ggml_blocks._dequantize_blocks's operations in its order."""
    if FMT == "q4_0":  # d | 16 B nibbles: element p < 16 is byte p's low nibble, p + 16 its high one
        q = (_byte(blk, 2 + p % 16, mask) >> ((p // 16) * 4)) & 15
        w = _half(blk, 0, mask) * (q - 8).to(tl.float32)
    elif FMT == "q5_0":  # d | qh u32 (bit p: element p's fifth bit) | 16 B nibbles
        q = (_byte(blk, 6 + p % 16, mask) >> ((p // 16) * 4)) & 15
        q = q | ((_byte(blk, 2 + p // 8, mask) >> (p % 8)) & 1) << 4
        w = _half(blk, 0, mask) * (q - 16).to(tl.float32)
    elif FMT == "q5_1":  # d | m | qh u32 | 16 B nibbles
        q = (_byte(blk, 8 + p % 16, mask) >> ((p // 16) * 4)) & 15
        q = q | ((_byte(blk, 4 + p // 8, mask) >> (p % 8)) & 1) << 4
        w = _half(blk, 0, mask) * q.to(tl.float32) + _half(blk, 2, mask)
    elif FMT == "q6_k":  # 128 B ql | 64 B qh | 16 int8 scales | d; half h = p // 128 of the super-block
        h = p // 128
        r = p % 128
        ql = (_byte(blk, 64 * h + r % 64, mask) >> ((r // 64) * 4)) & 15
        qh = (_byte(blk, 128 + 32 * h + r % 32, mask) >> ((r // 32) * 2)) & 3
        sc = tl.load(blk + 192 + p // 16, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        dl = _half(blk, 208, mask) * sc  # one scale per 16 weights
        w = dl * ((ql | (qh << 4)) - 32).to(tl.float32)
    else:  # q4_k, q5_k: d | dmin | 12 B of 6-bit scales and minimums | (q5_k: 32 B fifth bits) | 128 B nibbles
        s = p // 32  # sub-block
        j = p % 32  # place in the sub-block
        # get_scale_min_k4: sub-blocks 0-3 keep 6 bits of bytes s, s + 4; 4-7 take 4 bits of byte s + 4 and
        # the top 2 of bytes s - 4 (scale), s (minimum)
        a = _byte(blk, 4 + s % 4, mask)
        b = _byte(blk, 8 + s % 4, mask)
        c = _byte(blk, 12 + s % 4, mask)
        low = s < 4
        sc = tl.where(low, a & 63, (c & 15) | ((a >> 2) & 48))
        mn = tl.where(low, b & 63, (c >> 4) | ((b >> 2) & 48))
        dl = _half(blk, 0, mask) * sc.to(tl.float32)
        ml = _half(blk, 2, mask) * mn.to(tl.float32)
        if FMT == "q4_k":  # sub-block s: the low (s even) or high nibbles of bytes 32 (s // 2) .. + 31
            q = (_byte(blk, 16 + 32 * (s // 2) + j, mask) >> ((s % 2) * 4)) & 15
        else:  # q5_k: bit s of qh byte j is the fifth bit
            q = (_byte(blk, 48 + 32 * (s // 2) + j, mask) >> ((s % 2) * 4)) & 15
            q = q | ((_byte(blk, 16 + j, mask) >> s) & 1) << 4
        w = dl * q.to(tl.float32) - ml
    return w


@_triton_jit
def _blocks_gemv_kernel(
    x_ptr,  # [B, I] fp32
    raw_ptr,  # uint8 [O, I / N * NBYTES]: each row its blocks
    y_ptr,  # [B, O] fp32
    B, I, O,
    FMT: tl.constexpr,  # a BLOCK_FORMATS key
    N: tl.constexpr,  # weights per block
    NBYTES: tl.constexpr,  # bytes per block
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
    row = raw_ptr + offs_o.to(tl.int64) * (I // N * NBYTES)  # [BLOCK_O] start of each row (int64: big heads)
    acc = tl.zeros((BLOCK_B, BLOCK_O), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K] input columns
        mask_k = offs_k < I
        blk = row[:, None] + ((offs_k // N) * NBYTES)[None, :]  # [BLOCK_O, BLOCK_K] each weight's block
        w = _dequant_tile(blk, (offs_k % N)[None, :], mask_o[:, None] & mask_k[None, :], FMT)
        x = tl.load(x_ptr + offs_b[:, None] * I + offs_k[None, :], mask=mask_b[:, None] & mask_k[None, :],
                    other=0.0)  # [BLOCK_B, BLOCK_K]
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    tl.store(y_ptr + offs_b[:, None] * O + offs_o[None, :], acc, mask=mask_b[:, None] & mask_o[None, :])


def _check(x: torch.Tensor, raw: torch.Tensor, fmt: str) -> tuple[int, int, int]:
    """Checks fmt and the blocks against x [B, I] (fp32); returns (B, I, O)."""
    if fmt not in BLOCK_FORMATS:
        raise ValueError(f"fmt {fmt!r}: expected one of {tuple(BLOCK_FORMATS)}")
    if x.dim() != 2 or x.dtype != torch.float32:
        raise ValueError(f"x must be fp32 [B, I], got {x.dtype} {tuple(x.shape)}")
    b, i = x.shape
    if i % BLOCK_FORMATS[fmt][0]:
        raise ValueError(f"x's in_features {i} is not a multiple of {fmt}'s block of {BLOCK_FORMATS[fmt][0]}")
    per_row = row_bytes(fmt, i)
    if raw.dim() != 2 or raw.dtype != torch.uint8 or raw.shape[1] != per_row:
        raise ValueError(f"raw must be uint8 [O, {per_row}] ({fmt} blocks of {i} inputs), "
                         f"got {raw.dtype} {tuple(raw.shape)}")
    return b, i, raw.shape[0]


def blocks_linear(x: torch.Tensor, raw: torch.Tensor, fmt: str) -> torch.Tensor:
    """x [B, I] fp32 @ dequant(raw in fmt)^T -> [B, O] fp32 on CUDA (or CPU tensors under TRITON_INTERPRET=1);
    equals ggml_blocks.blocks_linear_reference up to the fp32 sum's order."""
    b, i, o = _check(x, raw, fmt)
    _check_launchable({"x": x, "raw": raw})
    n, nbytes = BLOCK_FORMATS[fmt]
    y = torch.empty(b, o, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(o, BLOCK_O), triton.cdiv(b, BLOCK_B))
    # no FMA contraction: each weight is the reference's product, then its sum, rounded apart
    _blocks_gemv_kernel[grid](x, raw, y, b, i, o, FMT=fmt, N=n, NBYTES=nbytes,
                              BLOCK_B=BLOCK_B, BLOCK_O=BLOCK_O, BLOCK_K=BLOCK_K, enable_fp_fusion=False)
    return y
