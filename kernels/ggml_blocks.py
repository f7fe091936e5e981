"""llama.cpp's block formats as a GGUF file stores them, read from their raw bytes: the plain-torch reference
of the CPU kernels' `blocks_linear` / `blocks_dequantize` (kernels/kquant_cpu.cpp) and of the CUDA one's
`blocks_linear` (kernels/kquant_gemv.py).

A weight [O, I] in one of these formats is uint8 [O, I / n * bytes]: each row its blocks of n weights along I,
each block `bytes` bytes exactly as ggml lays it out (fp16 scales inside the block). Dequantization computes what
gguf's numpy reference (gguf.quants.dequantize) computes, in the same order of fp32 roundings, so the two are
equal bit for bit (tests/test_kquant.py):

    q4_0  32 w, 18 B: d fp16, 16 B nibbles               w = d * (q - 8)
    q5_0  32 w, 22 B: d fp16, qh u32, 16 B nibbles       w = d * (q - 16)           q = nibble | bit << 4
    q5_1  32 w, 24 B: d, m fp16, qh u32, 16 B nibbles    w = d * q + m
    q4_k 256 w, 144 B: d, dmin fp16, 12 B of 6-bit scales and minimums (8 each), 128 B nibbles
                       w = (d * sc) * q - (dmin * mn), per sub-block of 32
    q5_k 256 w, 176 B: as q4_k, then 32 B of fifth bits (bit s of byte j: sub-block s's element j), 128 B nibbles
    q6_k 256 w, 210 B: 128 B low nibbles, 64 B high 2-bit pairs, 16 int8 scales (one per 16 weights), d fp16
                       w = (d * sc) * (q - 32)

In a block of 32 (q4_0, q5_0, q5_1) element j < 16 is byte j's low nibble, j + 16 its high nibble, and its fifth
bit is bit j of qh. In q4_k / q5_k sub-block s (32 weights) is the low (s even) or high (s odd) nibbles of bytes
32 (s // 2) .. + 31. In q6_k sub-block s = 4h + j is, for half h, the low (j < 2) or high nibbles of ql bytes
64 h + 32 (j % 2) .. + 31 with bits 2j, 2j + 1 of qh bytes 32 h .. + 31 above them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# format -> (weights per block, bytes per block)
BLOCK_FORMATS = {"q4_0": (32, 18), "q5_0": (32, 22), "q5_1": (32, 24),
                 "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210)}


def row_bytes(fmt: str, in_features: int) -> int:
    """Bytes of one row of in_features weights in fmt; ValueError for an unknown format or a ragged row."""
    if fmt not in BLOCK_FORMATS:
        raise ValueError(f"block format {fmt!r}: expected one of {tuple(BLOCK_FORMATS)}")
    n, nbytes = BLOCK_FORMATS[fmt]
    if in_features % n:
        raise ValueError(f"{fmt} needs an input dim that is a multiple of {n}, got {in_features}")
    return in_features // n * nbytes


def _half(blk: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte `at` of each block [N, bytes] -> fp32 [N, 1]."""
    return blk[:, at:at + 2].contiguous().view(torch.float16).float()


def _nibbles32(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [N, 16] -> int32 [N, 32]: the low nibbles, then the high ones."""
    q = qs.int()
    return torch.cat((q & 15, q >> 4), dim=-1)


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """uint8 [N, 4] (a little-endian u32) -> int32 [N, 32]: bit j as element j."""
    word = qh.long()
    word = word[:, 0] | word[:, 1] << 8 | word[:, 2] << 16 | word[:, 3] << 24
    return ((word[:, None] >> torch.arange(32)) & 1).int()


def _scale_min_k4(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q4_k / q5_k's 12 bytes [N, 12] -> (scales, minimums) int32 [N, 8] of 6 bits each."""
    s = sc.int()
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scales = torch.cat((d & 63, (md & 15) | ((d >> 2) & 48)), dim=-1)
    mins = torch.cat((m & 63, (md >> 4) | ((m >> 2) & 48)), dim=-1)
    return scales, mins


def _dequantize_blocks(blk: torch.Tensor, fmt: str) -> torch.Tensor:
    """blk uint8 [N, bytes] -> fp32 [N, n]."""
    nb = blk.shape[0]
    if fmt == "q4_0":
        return _half(blk, 0) * (_nibbles32(blk[:, 2:18]) - 8).float()
    if fmt == "q5_0":
        q = _nibbles32(blk[:, 6:22]) | _bits32(blk[:, 2:6]) << 4
        return _half(blk, 0) * (q - 16).float()
    if fmt == "q5_1":
        q = _nibbles32(blk[:, 8:24]) | _bits32(blk[:, 4:8]) << 4
        return _half(blk, 0) * q.float() + _half(blk, 2)
    if fmt in ("q4_k", "q5_k"):
        sc, mn = _scale_min_k4(blk[:, 4:16])
        dl = (_half(blk, 0) * sc.float())[..., None]  # [N, 8, 1]
        ml = (_half(blk, 2) * mn.float())[..., None]
        qs = blk[:, 16:144] if fmt == "q4_k" else blk[:, 48:176]
        q = qs.int().reshape(nb, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.int32).view(1, 1, 2, 1)
        q = (q & 15).reshape(nb, 8, 32)
        if fmt == "q5_k":
            qh = blk[:, 16:48].int().reshape(nb, 1, 32) >> torch.arange(8, dtype=torch.int32).view(1, 8, 1)
            q = q | (qh & 1) << 4
        return (dl * q.float() - ml).reshape(nb, 256)
    if fmt == "q6_k":
        ql = blk[:, 0:128].int().reshape(nb, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.int32).view(1, 1, 2, 1)
        ql = (ql & 15).reshape(nb, 8, 32)
        qh = blk[:, 128:192].int().reshape(nb, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.int32).view(1, 1, 4, 1)
        qh = (qh & 3).reshape(nb, 8, 32)
        q = ((ql | qh << 4) - 32).reshape(nb, 16, 16).float()
        dl = (_half(blk, 208) * blk[:, 192:208].view(torch.int8).float())[..., None]  # [N, 16, 1]
        return (dl * q).reshape(nb, 256)
    raise ValueError(f"block format {fmt!r}: expected one of {tuple(BLOCK_FORMATS)}")


def dequantize_blocks_reference(raw: torch.Tensor, fmt: str) -> torch.Tensor:
    """raw uint8 [O, I / n * bytes] in fmt -> fp32 [O, I], equal to gguf.quants.dequantize bit for bit."""
    n, nbytes = BLOCK_FORMATS.get(fmt, (0, 0))
    if not n:
        raise ValueError(f"block format {fmt!r}: expected one of {tuple(BLOCK_FORMATS)}")
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % nbytes:
        raise ValueError(f"{fmt} blocks must be uint8 [O, G * {nbytes}], got {raw.dtype} {tuple(raw.shape)}")
    o = raw.shape[0]
    blk = raw.contiguous().view(-1, nbytes)
    return _dequantize_blocks(blk, fmt).reshape(o, -1)


def as_q8_0(raw: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """q4_0 / q5_0 blocks [O, G * bytes] re-encoded as Q8_0 planes without loss: (qs int8 [O, I] = q - 8 or q - 16,
    d fp16 [O, G], the block's own scale), whose d * qs is the same fp32 product gguf's dequantization computes.
    For a fused matrix whose parts mix these types with Q8_0 (Gemma 3's q/k in Q5_0, v in Q8_0)."""
    if fmt not in ("q4_0", "q5_0"):
        raise ValueError(f"only q4_0 and q5_0 re-encode as Q8_0 without loss, not {fmt!r}")
    nbytes = BLOCK_FORMATS[fmt][1]
    o = raw.shape[0]
    blk = raw.contiguous().view(-1, nbytes)
    if fmt == "q4_0":
        q = _nibbles32(blk[:, 2:18]) - 8
    else:
        q = (_nibbles32(blk[:, 6:22]) | _bits32(blk[:, 2:6]) << 4) - 16
    d = blk[:, 0:2].contiguous().view(torch.float16)  # [O G, 1]
    return q.to(torch.int8).reshape(o, -1).contiguous(), d.reshape(o, -1).contiguous()


def blocks_linear_reference(x: torch.Tensor, raw: torch.Tensor, fmt: str) -> torch.Tensor:
    """x [B, I] fp32 @ dequantize_blocks_reference(raw, fmt)^T -> [B, O] fp32: what the kernel must equal."""
    return F.linear(x.float(), dequantize_blocks_reference(raw, fmt))


# fp16 scales of random blocks: weights of about 0.1 (a K-quant's weight is d times a 6-bit scale times q)
RANDOM_SCALE = {"q4_0": 0.01, "q5_0": 0.01, "q5_1": 0.01, "q4_k": 2e-4, "q5_k": 1e-4, "q6_k": 5e-5}


def random_blocks(o: int, i: int, fmt: str, gen: torch.Generator, scale: float | None = None) -> torch.Tensor:
    """uint8 [O, I / n * bytes] of random blocks: random bytes, the fp16 scales drawn from [-scale, scale] (q4_k's and
    q5_k's d, dmin from [0, scale], as a quantizer writes them; scale None: RANDOM_SCALE's), for tests and timing."""
    n, nbytes = BLOCK_FORMATS[fmt]
    scale = RANDOM_SCALE[fmt] if scale is None else scale
    raw = torch.randint(0, 256, (o * (i // n), nbytes), dtype=torch.uint8, generator=gen)
    halves = {"q4_0": (0,), "q5_0": (0,), "q5_1": (0, 2), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}[fmt]
    for at in halves:
        lo = 0.0 if fmt in ("q4_k", "q5_k") else -scale
        h = torch.empty(raw.shape[0], 1).uniform_(lo, scale, generator=gen).half()
        raw[:, at:at + 2] = h.view(torch.uint8)
    return raw.view(o, -1)
