"""Weight formats: a format is a Linear variant chosen at load; model.py's layer code does not change.

    fp32, bf16  plain tensors (model.Linear)
    q8          llama.cpp's Q8_0: int8 in blocks of 32 along the input dim, one fp16 scale per block
    q4          llama.cpp's Q4_1: 4-bit in blocks of 32, fp16 scale d and minimum m: w = d * q + m
    q8a8, q4a8  the same weights with the activations quantized too, per block of 32 to int8 (llama.cpp's
                Q8_1), multiplied with integer dot products (kernels/lowbit_cpu.cpp's *_linear_i8): as llama.cpp
                computes; changes outputs (an approximation of the activations, like bf16's)
    q4_k, q5_k, q6_k, q4_0, q5_0, q5_1
                a GGUF file's own blocks, kept in its bytes (kernels/ggml_blocks.py: the layouts and the
                reference; kernels/kquant_cpu.cpp: the CPU kernel; kernels/kquant_gemv.py: the CUDA one); never
                made by quantize() here, only read from a file (weights="gguf": every matrix in the checkpoint's
                own format)

Quantizing is round-to-nearest exactly as llama.cpp's reference (quantize_row_q4_1_ref /
quantize_row_q8_0_ref). SmolLM2's GGUF holds Q4_1 layers and a Q8_0 embedding; the converted
directory stores their dequantized values, and quantizing those again gives back the file's own
blocks bit for bit (tests/test_quant.py checks every block against the file). So `weights="q4"` on
that directory runs the model itself, not an approximation of it.

In q4 and q8 the embedding / LM head is Q8_0 (as llama.cpp keeps it in this file); the layers take
the format asked for. Linears compute in fp32 whatever the model dtype: the CPU kernel
(kernels/lowbit_cpu.cpp) dequantizes in registers and reads each weight once per call; many rows
(prefill) dequantize the weight and use a dense GEMM; CUDA uses kernels/lowbit_gemv.py (the block formats
kernels/kquant_gemv.py).
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.ggml_blocks import BLOCK_FORMATS, dequantize_blocks_reference
from kernels.reference_math import dequantize_reference as dequantize_planes, lowbit_linear_i8_reference

log = logging.getLogger(__name__)

WEIGHT_FORMATS = ("fp32", "bf16", "q8", "q4", "q8a8", "q4a8", "gguf")
NATIVE = "gguf"  # every matrix in its GGUF file's own format (block formats as stored, Q4_1 / Q8_0 as planes)
LOW_BIT = ("q8", "q4")  # the weight planes' formats
ACT8 = {"q8a8": "q8", "q4a8": "q4"}  # formats with int8 activations -> their planes'


def planes_of(weights: str | None) -> tuple[str | None, bool]:
    """A weights format -> (its planes' low-bit format or None for a dense one, whether activations are int8)."""
    if weights in ACT8:
        return ACT8[weights], True
    return (weights if weights in LOW_BIT else None), False
QK = 32  # weights per block
DENSE_ROW_CANDIDATES = (32, 64, 96, 128, 192)  # where a low-bit linear may switch to dequantize + GEMM


@dataclass
class QuantWeight:
    """A weight [O, I] in blocks along I. q4: qs uint8 [O, I/2] (block g of a row is bytes
    16g..16g+15; element j < 16 is the low nibble of byte j, element j + 16 its high nibble),
    m fp16 [O, I/QK]; q8: qs int8 [O, I], m None. d fp16 [O, I/QK]. A GGUF block format (BLOCK_FORMATS):
    qs uint8 [O, I / n * bytes], the file's blocks as they are (scales inside), d and m None."""

    fmt: str
    qs: torch.Tensor
    d: torch.Tensor | None = None  # None only in a block format
    m: torch.Tensor | None = None
    act8: bool = False  # products with int8-quantized activations (q4a8 / q8a8), not fp32 ones

    @property
    def format(self) -> str:
        """The weights format (WEIGHT_FORMATS) this weight computes in: fmt, with "a8" for int8 activations."""
        return self.fmt + ("a8" if self.act8 else "")

    def __post_init__(self):
        if self.fmt in BLOCK_FORMATS:
            if self.qs.dtype != torch.uint8 or self.qs.dim() != 2 or self.qs.shape[1] % BLOCK_FORMATS[self.fmt][1]:
                raise ValueError(f"{self.fmt} blocks must be uint8 [O, G * {BLOCK_FORMATS[self.fmt][1]}], got "
                                 f"{self.qs.dtype} {tuple(self.qs.shape)}")
            if self.d is not None or self.m is not None or self.act8:
                raise ValueError(f"{self.fmt} keeps its scales inside its blocks (d, m None) and has fp32 activations")
            return
        if self.fmt not in LOW_BIT:
            raise ValueError(f"QuantWeight format {self.fmt!r}: expected one of {LOW_BIT + tuple(BLOCK_FORMATS)}")
        if self.d is None or self.d.dtype != torch.float16 or (self.m is not None and self.m.dtype != torch.float16):
            raise ValueError("QuantWeight scales must be float16")
        if (self.fmt == "q4") != (self.m is not None):
            raise ValueError("q4 needs a minimum m; q8 has none")

    @property
    def blocks(self) -> bool:
        """Whether this is a GGUF block format in the file's own bytes (not Q4_1 / Q8_0 planes)."""
        return self.fmt in BLOCK_FORMATS

    @property
    def shape(self) -> tuple[int, int]:
        if self.blocks:
            n, nbytes = BLOCK_FORMATS[self.fmt]
            return self.qs.shape[0], self.qs.shape[1] // nbytes * n
        return self.qs.shape[0], self.d.shape[1] * QK

    @property
    def device(self) -> torch.device:
        return self.qs.device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)

    def rows(self, idx: torch.Tensor | slice) -> QuantWeight:
        """The weight of output rows idx (index tensor or slice); blocks run along I so rows split cleanly."""
        pick = (lambda t: None if t is None else t[idx].contiguous())
        return QuantWeight(self.fmt, pick(self.qs), pick(self.d), pick(self.m), self.act8)

    def to(self, device: torch.device | str) -> QuantWeight:
        move = (lambda t: None if t is None else t.to(device))
        return QuantWeight(self.fmt, move(self.qs), move(self.d), move(self.m), self.act8)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[O, I] in dtype; the CPU kernel where it builds, else dequantize_reference (equal bit for bit)."""
        if self.device.type == "cpu" and cpu_kernel() is not None:
            k = cpu_kernel()
            w = k.blocks_dequantize(self.qs, self.fmt, self.shape[1]) if self.blocks else k.dequantize(self.qs, self.d, self.m)
        else:
            w = dequantize_reference(self)
        return w.to(dtype)


ROWS_AT_ONCE = 8192  # rows quantized (or compared) at a time: no fp32 temporaries of a vocabulary's matrix


def quantize(w: torch.Tensor, fmt: str) -> QuantWeight:
    """Round-to-nearest blocks of w [O, I] (I a multiple of 32), computed in fp32 on w's device, ROWS_AT_ONCE rows
    at a time."""
    if fmt not in LOW_BIT:
        raise ValueError(f"cannot quantize to {fmt!r}: expected one of {LOW_BIT}")
    if w.dim() != 2 or w.shape[1] % QK:
        raise ValueError(f"cannot quantize a weight of shape {tuple(w.shape)} to {fmt}: "
                         f"the input dim must be a multiple of {QK}")
    o, i = w.shape
    if o > ROWS_AT_ONCE:
        parts = [quantize(w[a : a + ROWS_AT_ONCE], fmt) for a in range(0, o, ROWS_AT_ONCE)]
        cat = (lambda name: None if getattr(parts[0], name) is None else torch.cat([getattr(p, name) for p in parts]))
        return QuantWeight(fmt, cat("qs"), cat("d"), cat("m"))
    x = w.detach().float().reshape(o, i // QK, QK)
    if fmt == "q8":  # quantize_row_q8_0_ref: d = amax / 127, q = round(x / d)
        d = x.abs().amax(-1) / 127.0
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        q = _round_half_away(x * inv[..., None]).to(torch.int8)
        return QuantWeight("q8", q.reshape(o, i).contiguous(), d.half().contiguous())
    # quantize_row_q4_1_ref: d = (max - min) / 15, q = min(15, trunc((x - min) / d + 0.5))
    lo, hi = x.amin(-1), x.amax(-1)
    d = (hi - lo) / 15.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = ((x - lo[..., None]) * inv[..., None] + 0.5).to(torch.int8).clamp_(max=15).to(torch.uint8)  # [O, G, 32]
    qs = q[..., : QK // 2] | (q[..., QK // 2 :] << 4)
    return QuantWeight("q4", qs.reshape(o, i // 2).contiguous(), d.half().contiguous(), lo.half().contiguous())


def squared_error(qw: QuantWeight, w: torch.Tensor) -> tuple[float, float]:
    """(sum of (dequantize(qw) - w)^2, sum of w^2), ROWS_AT_ONCE rows at a time."""
    err = norm = 0.0
    for a in range(0, w.shape[0], ROWS_AT_ONCE):
        part = w[a : a + ROWS_AT_ONCE].float()
        err += float((qw.rows(slice(a, a + ROWS_AT_ONCE)).dequantize() - part).pow(2).sum())
        norm += float(part.pow(2).sum())
    return err, norm


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    """C's roundf (halves away from zero; torch.round rounds them to even). x - trunc(x) is exact in fp32."""
    r = torch.trunc(x)
    return r + torch.sign(x) * ((x - r).abs() >= 0.5)


def dequantize_reference(qw: QuantWeight) -> torch.Tensor:
    """fp32 [O, I], computed as gguf's numpy reference does (kernels.lowbit_gemv's, the one definition)."""
    if qw.blocks:
        return dequantize_blocks_reference(qw.qs, qw.fmt)
    return dequantize_planes(qw.qs, qw.d, qw.m if qw.fmt == "q4" else None)


def linear_reference(x: torch.Tensor, qw: QuantWeight, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., I] @ dequantize(qw).T (+ b) in fp32 (act8: x quantized per block, integer products), returned
    in x's dtype: what every kernel must equal."""
    if qw.act8:
        x2 = x.reshape(-1, x.shape[-1]).float()
        y = lowbit_linear_i8_reference(x2, qw.qs, qw.d, qw.m).reshape(*x.shape[:-1], -1)
        return (y if b is None else y + b.float()).to(x.dtype)
    y = F.linear(x.float(), dequantize_reference(qw), None if b is None else b.float())
    return y.to(x.dtype)


_KERNEL_STATE: dict[str, object] = {}


def cpu_kernel():
    """kernels.cpu_ext's module (the low-bit linears and the fused layer pieces), or None where it
    cannot be built (warned once)."""
    if "cpu" not in _KERNEL_STATE:
        from kernels.cpu_ext import CpuKernelUnavailable, lowbit_cpu

        try:
            _KERNEL_STATE["cpu"] = lowbit_cpu()
        except CpuKernelUnavailable as e:
            log.warning("%s; low-bit linears run the plain-torch reference (slow)", e)
            _KERNEL_STATE["cpu"] = None
    return _KERNEL_STATE["cpu"]


@functools.lru_cache(maxsize=1)
def _has_triton() -> bool:
    """Whether triton imports (kernels/kquant_gemv.py's CUDA kernel; the block formats dequantize + GEMM without it)."""
    from kernels.predictor import triton_mode

    return triton_mode() is not None


@functools.lru_cache(maxsize=None)
def dense_rows(dtype: torch.dtype = torch.float32) -> int:
    """Rows from which dequantizing a weight and running a dense GEMM beats the kernel (prefill) for activations
    in dtype, measured once per process and dtype on a random q4 [3072, 576] weight (tens of ms): the crossover
    moves with the CPU's SIMD, its bf16 units and the BLAS."""
    gen = torch.Generator().manual_seed(0)
    qw = random_weight(3072, 576, "q4", torch.float32, gen)
    kernel, dense = QuantLinear(qw, dense_rows=1 << 30), QuantLinear(qw, dense_rows=1)
    rows = _crossover(DENSE_ROW_CANDIDATES, gen, dtype, 4, lambda x: dense(x), lambda x: kernel(x))
    log.info("low-bit linears, %s activations: dequantize + GEMM from %d rows (measured)", dtype_name(dtype), rows)
    return rows


def _crossover(candidates: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype, repeats: int,
               challenger, incumbent) -> int:
    """The first row count of candidates at which challenger(x) runs faster than incumbent(x) (best of repeats each,
    x random [rows, 576] in dtype); the last candidate when it never does."""
    import time

    def ms(call, x: torch.Tensor) -> float:
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            call(x)
            best = min(best, time.perf_counter() - t)
        return best

    for rows in candidates:
        x = torch.randn(rows, 576, generator=gen).to(dtype)
        if ms(challenger, x) < ms(incumbent, x):
            return rows
    return candidates[-1]


class QuantLinear:
    """y = x @ dequant(qw).T (+ b), same call as model.Linear. Few rows: the fused kernel; dense_rows or
    more (measured, see dense_rows()): dequantize once per call and a dense GEMM (the weight is never kept
    dequantized), in fp32, or in bf16 for bf16 activations where the CPU has bf16 units (the weights rounded to
    bf16: what a bf16 engine computes with every row count)."""

    def __init__(self, qw: QuantWeight, b: torch.Tensor | None = None, dense_rows: int | None = None):
        self.qw, self.b = qw, b
        self._dense_rows = dense_rows
        self.out_features, self.in_features = qw.shape
        self.held: torch.Tensor | None = None  # a bf16 copy (hold)
        self.held_when: HoldSwitch | None = None

    def hold(self, when: HoldSwitch) -> int:
        """Keep the weight dequantized and rounded to bf16, and compute with it while `when` is on, from its row
        count on: bf16 GEMMs on bf16 units, the arithmetic a bf16 engine computes with, where the blocks' kernels and
        fp32 GEMMs are several times slower (a model's prefill: DecoderModel.hold_for_prefill; its LM head at every
        call: DecoderModel.hold_head). Returns the bytes held."""
        w = self.qw.dequantize(torch.bfloat16)
        # oneDNN's blocked layout, made once: F.linear on the plain layout reorders the weight on every call
        self.held = torch.ops.mkldnn._reorder_linear_weight(w, 1) if _native_bf16() else w
        self.held_when = when
        return w.numel() * w.element_size()

    def dense_from(self, n: int, dtype: torch.dtype = torch.float32) -> bool:
        """Whether n rows of activations in dtype take the dequantize + GEMM path (prefill) rather than the
        kernel."""
        if self._held_now(n):
            return True
        if self._dense_rows:
            return n >= self._dense_rows
        if self.qw.device.type == "cpu":
            return n >= DENSE_ROW_CANDIDATES[0] and n >= dense_rows(_gemm_dtype(dtype))
        return n >= DENSE_ROW_CANDIDATES[-1]

    def _dense(self, x2: torch.Tensor) -> torch.Tensor:
        """Dequantize + GEMM over x2 [N, I]: the held bf16 copy in a prefill; in bf16 where x2 is bf16 on a CPU with
        bf16 units; else fp32."""
        if self._held_now(x2.shape[0]):
            return self._held_gemm(x2)
        if _gemm_dtype(x2.dtype) == torch.bfloat16 and self.qw.device.type == "cpu":
            return F.linear(x2, self.qw.dequantize(torch.bfloat16))
        return F.linear(x2.float(), self.qw.dequantize())

    def _held_gemm(self, x2: torch.Tensor) -> torch.Tensor:
        x2 = x2.to(torch.bfloat16)
        if _native_bf16():
            return torch.ops.mkldnn._linear_pointwise(x2, self.held, None, "none", [], "")
        return F.linear(x2, self.held)

    def _held_now(self, n: int) -> bool:
        """n rows take the held bf16 copy: while its switch is on, from the switch's rows on (a prefill's: held_rows(),
        since fewer rows read its 2 bytes a weight where the blocks read about half a byte)."""
        when = self.held_when
        return when is not None and when.on and n >= (when.rows or held_rows())

    def _finish(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.b is not None:
            y = y.float() + self.b.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        n = x2.shape[0]
        qw = self.qw
        if qw.act8:  # int8 activations at every row count: a row's numbers never depend on the others beside it
            k = cpu_kernel() if qw.device.type == "cpu" else None
            if k is None:
                return linear_reference(x, qw, self.b)
            x2 = x2.float().contiguous()
            return self._finish(k.q4_linear_i8(x2, qw.qs, qw.d, qw.m) if qw.fmt == "q4" else k.q8_linear_i8(x2, qw.qs, qw.d), x)
        if self.dense_from(n, x2.dtype):
            return self._finish(self._dense(x2.contiguous()), x)
        if qw.blocks:  # a GGUF block format: its kernel (fp32 activations)
            x2 = x2.float().contiguous()
            if qw.device.type == "cpu" and (k := cpu_kernel()) is not None:
                y = k.blocks_linear(x2, qw.qs, qw.fmt)
            elif qw.device.type == "cuda" and _has_triton():
                from kernels.kquant_gemv import blocks_linear

                y = blocks_linear(x2, qw.qs, qw.fmt)
            else:
                y = F.linear(x2, qw.dequantize())
            return self._finish(y, x)
        if (x.dtype == torch.bfloat16 and n > 1 and qw.device.type == "cpu" and (k := cpu_kernel()) is not None
                and k.has_bf16()):
            # bf16 activations, several rows: bf16 dot products (the weights rounded to bf16 as a bf16
            # engine holds them); one row stays on the fp32 path, which is faster there
            return self._finish(k.linear_bf16(x2.contiguous(), qw.qs, qw.d, qw.m), x)
        x2 = x2.float().contiguous()
        if qw.device.type == "cuda":
            from kernels.lowbit_gemv import lowbit_linear

            y = lowbit_linear(x2, qw.qs, qw.d, qw.m)
        elif (k := cpu_kernel()) is not None:
            y = k.q4_linear(x2, qw.qs, qw.d, qw.m) if qw.fmt == "q4" else k.q8_linear(x2, qw.qs, qw.d)
        else:
            y = F.linear(x2, dequantize_reference(qw))
        return self._finish(y, x)


@functools.lru_cache(maxsize=1)
def held_rows() -> int:
    """Rows from which a held bf16 copy (oneDNN's packed layout) multiplies faster than the q4 kernel, measured once per
    process over four distinct random [3072, 576] weights in turn (streaming from memory, as a model's layers do)."""
    gen = torch.Generator().manual_seed(0)
    lins = [QuantLinear(random_weight(3072, 576, "q4", torch.float32, gen), dense_rows=1 << 30) for _ in range(4)]
    for lin in lins:
        lin.hold(HoldSwitch())  # (off: calls take the kernel)
    rows = _crossover(HELD_ROW_CANDIDATES, gen, torch.float32, 3, lambda x: [lin._held_gemm(x) for lin in lins],
                      lambda x: [lin(x) for lin in lins])
    log.info("prefill: held bf16 copies from %d rows (measured)", rows)
    return rows


HELD_ROW_CANDIDATES = (8, 16, 32, 64)


class HoldSwitch:
    """When linears holding a bf16 copy (QuantLinear.hold) compute with it: while `on`, calls of `rows` rows or more
    (None: held_rows(), measured). A model's prefill switch is on during its prompt chunks; a head held for every
    call has one always on, from one row."""

    def __init__(self, on: bool = False, rows: int | None = None):
        self.on, self.rows = on, rows


def holds_bf16(dtype: torch.dtype) -> bool:
    """Whether an engine of this dtype, on low-bit weights with fp32 activations, may hold bf16 copies of its matrices
    (prefill through them; its LM head where that was measured faster): where dtype auto resolved to bf16 (the CPU
    computes it natively), so bf16 rounding is the default's contract."""
    return dtype == torch.bfloat16 and _native_bf16()


def _gemm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a dequantize + GEMM runs in for activations in dtype: bf16 where the CPU multiplies bf16 natively."""
    return torch.bfloat16 if dtype == torch.bfloat16 and _native_bf16() else torch.float32


@functools.lru_cache(maxsize=1)
def _native_bf16() -> bool:
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def embedding(ids: torch.Tensor, w: torch.Tensor | QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """Rows ids [...] of an embedding table, dequantized if it is low-bit -> [..., D] in dtype."""
    if isinstance(w, torch.Tensor):
        return F.embedding(ids, w)
    flat = ids.reshape(-1)
    return dequantize_reference(w.rows(flat)).to(dtype).reshape(*ids.shape, -1)


def select_rows(w: torch.Tensor | QuantWeight, idx: torch.Tensor) -> torch.Tensor | QuantWeight:
    """w[idx] kept in w's format (a draft head's vocabulary-subset head stays low-bit)."""
    return w.rows(idx) if isinstance(w, QuantWeight) else w[idx].contiguous()


def take_rows(w: torch.Tensor | QuantWeight, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """w[idx] as a dense tensor in dtype (the predictors' LM-head rows, a draft head's vocabulary subset)."""
    if isinstance(w, torch.Tensor):
        return w[idx]
    return embedding(idx, w, dtype)


def weight_bytes(weights) -> int:
    """Resident bytes of a ModelWeights: every tensor and QuantWeight once (a tied head is counted once)."""
    seen: set[int] = set()
    total = 0

    def add(t) -> None:
        nonlocal total
        if t is None or id(t) in seen:
            return
        seen.add(id(t))
        total += t.nbytes if isinstance(t, QuantWeight) else t.numel() * t.element_size()

    for lw in weights.layers:
        for t in vars(lw).values():
            add(t)
    for t in (weights.embed, weights.norm, weights.lm_head):
        add(t)
    return total


def random_weight(o: int, i: int, fmt: str | None, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor | QuantWeight:
    """A random [o, i] weight stored as fmt (None: a dense tensor in dtype; q4a8 / q8a8: int8 activations), for
    timing only."""
    if fmt is None:
        return _tiled(o, i, lambda n: torch.empty(n, i, dtype=dtype).normal_(0, 0.02, generator=gen))
    if fmt in BLOCK_FORMATS:
        from kernels.ggml_blocks import random_blocks

        return QuantWeight(fmt, _tiled(o, 0, lambda n: random_blocks(n, i, fmt, gen)))
    planes, act8 = planes_of(fmt)
    g = i // QK
    d = _tiled(o, g, lambda n: torch.empty(n, g, dtype=torch.float16).uniform_(0, 0.01, generator=gen))
    if planes == "q8":
        qs = _tiled(o, i, lambda n: torch.randint(-127, 128, (n, i), dtype=torch.int8, generator=gen))
        return QuantWeight("q8", qs, d, act8=act8)
    m = _tiled(o, g, lambda n: torch.empty(n, g, dtype=torch.float16).uniform_(-0.05, 0, generator=gen))
    qs = _tiled(o, i // 2, lambda n: torch.randint(0, 256, (n, i // 2), dtype=torch.uint8, generator=gen))
    return QuantWeight("q4", qs, d, m, act8)


def _tiled(rows: int, cols: int, draw, block: int = 64) -> torch.Tensor:
    """[rows, cols] of `block` random rows (draw(n) -> [n, cols]) repeated: every byte is stored and streams
    from memory as a real weight's does (timing), at a fraction of drawing them all (a 135M model: ~0.1 s, not 2)."""
    head = draw(min(rows, block))
    if rows <= block:
        return head
    return head.repeat(-(-rows // block), 1)[:rows].contiguous()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
