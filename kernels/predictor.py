"""SpecEE T1 exit predictor as one fused Triton kernel, with its plain-torch reference.

After decoder layer l the engine asks: given the final-normed hidden state and the draft's K
candidate tokens, should this token exit here? Per row:

    z     = h_normed @ lm_head_weight[cand_ids].T           # [K] candidate logits
    p     = softmax(z)                                      # [K]
    x     = [z, p, p - prev_prob]                           # [3K] features
    x     = [z, p, p - prev_prob, draft_prob]               # [4K] with the draft's confidence ("zpdq")
    x     = [z, p, p - prev_prob, draft_prob, record]       # [5K] and the draft's record ("zpdqh")
    p_exit = sigmoid(w2 @ relu(w1 @ x + b1) + b2)           # scalar

plus the candidate with the largest logit (as a token id). The kernel does all of it in one
program per row, so the K LM-head rows are read once and nothing of size [B, 3K] or [B, H]
touches global memory. The torch reference takes features and MLP from kernels.reference_math,
their one definition (the engine's CPU scorer and the training data use it too).

`rmsnorm_cand_logits` is the optional companion: RMSNorm folded into the candidate logits.

Dispatch (`predictor_forward`): "auto" runs the kernel on CUDA tensors and the reference
otherwise; "triton" on CPU tensors needs TRITON_INTERPRET=1.

Triton is imported guarded, so `import kernels` works without it (macOS, CPU-only wheels):
the references need only torch. Triton decides interpreter-or-compiler once per process, when
it is first imported (TRITON_INTERPRET at that moment); `triton_mode()` reports which.
"""
from __future__ import annotations  # keeps `tl.constexpr` annotations lazy when triton is absent

import contextlib
from typing import Callable

import torch

from kernels.reference_math import LayerPredictor, exit_probability, predictor_features

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch references below still work
    triton = None
    tl = None

BACKENDS = ("auto", "triton", "torch")
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Chunk sizes: [BLOCK_K, BLOCK_D] LM-head tile per step of the D loop, [BLOCK_H, BLOCK_K]
# w1 tiles per step of the hidden loop. Large enough to keep loads wide on GPU, small enough
# to stay in registers with K <= 16.
_MAX_BLOCK_D = 512
_MAX_BLOCK_H = 128


def _triton_jit(fn: Callable) -> Callable:
    """`@triton.jit` where triton is installed; without it the kernel stays an inert function."""
    return fn if triton is None else triton.jit(fn)


# ----------------------------------------------------------------------------- kernels


@_triton_jit
def _fused_predictor_kernel(
    h_ptr,  # [B, D] final-normed hidden state, fp32/fp16/bf16
    cand_ptr,  # [B, K] int64 candidate token ids
    lm_ptr,  # [V, D] LM-head weight
    prev_ptr,  # [B, K] probabilities at the previous evaluated layer (zeros at the first)
    x_ptr,  # [B, EXTRA * K] per-row feature blocks after [z, p, shift]: draft_prob (, record); read when EXTRA
    w1_ptr,  # [H, (3 + EXTRA) K] first MLP layer
    b1_ptr,  # [H]
    w2_ptr,  # [H] second MLP layer ([1, H] contiguous)
    b2_ptr,  # [1]
    p_exit_ptr,  # [B] fp32 out
    cand_prob_ptr,  # [B, K] fp32 out
    argmax_ptr,  # [B] int64 out: candidate token id with the largest logit
    D,
    K: tl.constexpr,
    H: tl.constexpr,
    EXTRA: tl.constexpr,  # given feature blocks: 0 ("zpd"), 1 ("zpdq": q), 2 ("zpdqh": q, the draft's record)
    BLOCK_K: tl.constexpr,  # next power of two >= K
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    ids = tl.load(cand_ptr + row * K + offs_k, mask=mask_k, other=0)  # [BLOCK_K]

    # z = h @ W[ids].T, fp32 accumulation over D in chunks; padded k lanes stay 0.
    z = tl.zeros([BLOCK_K], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        h = tl.load(h_ptr + row * D + offs_d, mask=mask_d, other=0.0).to(tl.float32)  # [BLOCK_D]
        w = tl.load(
            lm_ptr + ids[:, None] * D + offs_d[None, :],
            mask=mask_k[:, None] & mask_d[None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_K, BLOCK_D]
        z += tl.sum(w * h[None, :], axis=1)

    # Softmax over the K real lanes; argmax = first index reaching the max (torch's rule).
    z_masked = tl.where(mask_k, z, float("-inf"))
    z_max = tl.max(z_masked, axis=0)
    ez = tl.exp(z_masked - z_max)  # padded lanes: exp(-inf) = 0
    p = ez / tl.sum(ez, axis=0)  # [BLOCK_K]
    first = tl.min(tl.where(mask_k & (z_masked == z_max), offs_k, BLOCK_K), axis=0)
    best_id = tl.sum(tl.where(offs_k == first, ids, 0), axis=0)
    prev = tl.load(prev_ptr + row * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    shift = p - prev

    # MLP: w1 @ [z, p, shift, extra...] is 3 + EXTRA [H, K] blocks of w1 against the feature parts;
    # the hidden layer is reduced into the output logit chunk by chunk.
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)  # per-lane partial sums of w2 @ relu(...)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask_h = offs_h < H
        w1_rows = w1_ptr + offs_h[:, None] * ((3 + EXTRA) * K) + offs_k[None, :]  # [BLOCK_H, BLOCK_K]
        mask_hk = mask_h[:, None] & mask_k[None, :]
        w1_z = tl.load(w1_rows, mask=mask_hk, other=0.0).to(tl.float32)
        w1_p = tl.load(w1_rows + K, mask=mask_hk, other=0.0).to(tl.float32)
        w1_s = tl.load(w1_rows + 2 * K, mask=mask_hk, other=0.0).to(tl.float32)
        pre = tl.sum(w1_z * z[None, :] + w1_p * p[None, :] + w1_s * shift[None, :], axis=1)
        # [K] loads per chunk: cheaper than holding them across the loop. The block index must not reuse a
        # name of the kernel's tensors (compiled Triton rejects the loop-carried type change; the interpreter
        # does not: caught on an H200)
        for blk in tl.static_range(EXTRA):
            x_b = tl.load(x_ptr + row * (EXTRA * K) + blk * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            w1_b = tl.load(w1_rows + (3 + blk) * K, mask=mask_hk, other=0.0).to(tl.float32)
            pre += tl.sum(w1_b * x_b[None, :], axis=1)
        pre += tl.load(b1_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)  # [BLOCK_H]
        w2 = tl.load(w2_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)  # [BLOCK_H]
        acc += tl.maximum(pre, 0.0) * w2
    logit = tl.sum(acc, axis=0) + tl.load(b2_ptr).to(tl.float32)

    tl.store(p_exit_ptr + row, tl.sigmoid(logit))
    tl.store(cand_prob_ptr + row * K + offs_k, p, mask=mask_k)
    tl.store(argmax_ptr + row, best_id)


@_triton_jit
def _rmsnorm_cand_logits_kernel(
    h_ptr,  # [B, D] hidden state before the final norm
    g_ptr,  # [D] RMSNorm weight
    cand_ptr,  # [B, K] int64 candidate token ids
    lm_ptr,  # [V, D] LM-head weight
    z_ptr,  # [B, K] fp32 out
    D,
    eps,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # rsqrt(mean(h^2) + eps) is one scalar per row, so it factors out of the dot products:
    # z = rsqrt(...) * ((h * g) @ W[ids].T), one pass over D.
    row = tl.program_id(0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    ids = tl.load(cand_ptr + row * K + offs_k, mask=mask_k, other=0)  # [BLOCK_K]
    sum_sq = tl.zeros([BLOCK_D], dtype=tl.float32)
    z = tl.zeros([BLOCK_K], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        h = tl.load(h_ptr + row * D + offs_d, mask=mask_d, other=0.0).to(tl.float32)  # [BLOCK_D]
        g = tl.load(g_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)  # [BLOCK_D]
        w = tl.load(
            lm_ptr + ids[:, None] * D + offs_d[None, :],
            mask=mask_k[:, None] & mask_d[None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_K, BLOCK_D]
        sum_sq += h * h
        z += tl.sum(w * (h * g)[None, :], axis=1)
    inv_rms = 1.0 / tl.sqrt(tl.sum(sum_sq, axis=0) / D + eps)
    tl.store(z_ptr + row * K + offs_k, z * inv_rms, mask=mask_k)


def triton_mode() -> str | None:
    """"interpreter" or "compiled": the mode triton was imported in; None without triton.

    Triton fixes the mode at import (its own `tl.zeros`, `tl.sum` are wrapped then, from
    TRITON_INTERPRET), so setting the variable later has no effect on this process."""
    if triton is None:
        return None
    from triton.runtime.interpreter import InterpretedFunction

    return "interpreter" if isinstance(tl.zeros, InterpretedFunction) else "compiled"


# ----------------------------------------------------------------------------- checks


def _check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}; expected one of float32, float16, bfloat16")


def _check_shape(name: str, t: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(t.shape) != expected:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {expected}")


def _check_same_device(named: dict[str, torch.Tensor]) -> None:
    device = next(iter(named.values())).device
    for name, t in named.items():
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}; expected {device} like the other inputs")


def _check_cand(h_name: str, named: dict[str, torch.Tensor]) -> tuple[int, int, int]:
    """Checks named[h_name] [B, D], cand_ids [B, K] int64, lm_head_weight [V, D]; returns (B, D, K)."""
    h, cand_ids, lm_head_weight = named[h_name], named["cand_ids"], named["lm_head_weight"]
    _check_float(h_name, h)
    if h.dim() != 2:
        raise ValueError(f"{h_name} has shape {tuple(h.shape)}; expected [B, D]")
    if cand_ids.dim() != 2 or cand_ids.shape[0] != h.shape[0] or cand_ids.shape[1] < 1:
        raise ValueError(f"cand_ids has shape {tuple(cand_ids.shape)}; expected [B={h.shape[0]}, K>=1]")
    if cand_ids.dtype != torch.int64:
        raise ValueError(f"cand_ids has dtype {cand_ids.dtype}; expected torch.int64")
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != h.shape[1]:
        raise ValueError(f"lm_head_weight has shape {tuple(lm_head_weight.shape)}; expected [V, D={h.shape[1]}]")
    _check_float("lm_head_weight", lm_head_weight)
    return h.shape[0], h.shape[1], cand_ids.shape[1]


def _check_predictor_args(named: dict[str, torch.Tensor]) -> tuple[int, int, int, int]:
    """Checks the fused-predictor inputs (by name; draft_prob, record optional); returns (B, D, K, H)."""
    B, D, K = _check_cand("h_normed", named)
    if "record" in named and "draft_prob" not in named:
        raise ValueError("record needs draft_prob (feature set zpdqh = [z, p, shift, draft_prob, record])")
    given = tuple(n for n in ("draft_prob", "record") if n in named)
    w1, parts = named["w1"], 3 + len(given)
    if w1.dim() != 2 or w1.shape[1] != parts * K or w1.shape[0] < 1:
        raise ValueError(f"w1 has shape {tuple(w1.shape)}; expected [H, {parts}K={parts * K}]"
                         + (f" (the features include {', '.join(given)})" if given else ""))
    H = w1.shape[0]
    floats = ("prev_prob", "w1", "b1", "w2", "b2") + given
    for name, expected in (("prev_prob", (B, K)), ("b1", (H,)), ("w2", (1, H)), ("b2", (1,)),
                           ("draft_prob", (B, K)), ("record", (B, K))):
        if name in named:
            _check_shape(name, named[name], expected)
    for name in floats:
        _check_float(name, named[name])
    _check_same_device(named)
    return B, D, K, H


def _predictor_named(h_normed, cand_ids, lm_head_weight, prev_prob, w1, b1, w2, b2, draft_prob,
                     record=None) -> dict:
    """The fused predictor's tensors by name (draft_prob, record only when given)."""
    named = dict(h_normed=h_normed, cand_ids=cand_ids, lm_head_weight=lm_head_weight, prev_prob=prev_prob,
                 w1=w1, b1=b1, w2=w2, b2=b2)
    for name, t in (("draft_prob", draft_prob), ("record", record)):
        if t is not None:
            named[name] = t
    return named


def _check_launchable(named: dict[str, torch.Tensor]) -> None:
    """Checks what the kernel itself needs: triton, a device it can run on, contiguity."""
    if triton is None:
        raise RuntimeError("backend 'triton' needs the triton package; use backend='torch'")
    from triton.runtime.interpreter import InterpretedFunction

    mode = triton_mode()
    if isinstance(_fused_predictor_kernel, InterpretedFunction) != (mode == "interpreter"):
        raise RuntimeError(
            "triton and kernels.predictor were imported under different TRITON_INTERPRET settings; "
            "set it before the first import of either"
        )
    device = next(iter(named.values())).device
    if device.type != "cuda" and mode != "interpreter":
        raise RuntimeError(
            f"the Triton kernel got {device.type} tensors; it needs CUDA tensors, or TRITON_INTERPRET=1 "
            "set before triton is imported to run in the interpreter (slow, for tests); "
            "use backend='torch' otherwise"
        )
    for name, t in named.items():
        if not t.is_contiguous():
            raise ValueError(f"{name} is not contiguous (strides {t.stride()}); pass {name}.contiguous()")


def _pow2(n: int, cap: int) -> int:
    return min(triton.next_power_of_2(n), cap)


# ----------------------------------------------------------------------------- fused predictor


def fused_predictor(
    h_normed: torch.Tensor,  # [B, D]
    cand_ids: torch.Tensor,  # [B, K] int64
    lm_head_weight: torch.Tensor,  # [V, D]
    prev_prob: torch.Tensor,  # [B, K]
    w1: torch.Tensor,  # [H, 3K]
    b1: torch.Tensor,  # [H]
    w2: torch.Tensor,  # [1, H]
    b2: torch.Tensor,  # [1]
    draft_prob: torch.Tensor | None = None,  # [B, K]: feature set "zpdq" (w1 [H, 4K])
    record: torch.Tensor | None = None,  # [B, K]: with draft_prob, feature set "zpdqh" (w1 [H, 5K])
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Runs the Triton kernel; returns p_exit [B] fp32, cand_prob [B, K] fp32, local_argmax [B]
    int64 (the candidate token id with the largest logit). Inputs must be contiguous and on one
    device; cand_ids must lie in [0, V) (not checked: that would cost a device sync)."""
    named = _predictor_named(h_normed, cand_ids, lm_head_weight, prev_prob, w1, b1, w2, b2, draft_prob, record)
    B, D, K, H = _check_predictor_args(named)
    _check_launchable(named)
    device = h_normed.device
    p_exit = torch.empty(B, dtype=torch.float32, device=device)
    cand_prob = torch.empty(B, K, dtype=torch.float32, device=device)
    local_argmax = torch.empty(B, dtype=torch.int64, device=device)
    if B == 0:
        return p_exit, cand_prob, local_argmax
    given = [t for t in (draft_prob, record) if t is not None]
    extra = (given[0] if len(given) == 1 else torch.cat(given, dim=1).contiguous()) if given else prev_prob
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _fused_predictor_kernel[(B,)](
            h_normed, cand_ids, lm_head_weight, prev_prob, extra,
            w1, b1, w2, b2, p_exit, cand_prob, local_argmax, D,
            K=K, H=H, EXTRA=len(given), BLOCK_K=triton.next_power_of_2(K),
            BLOCK_D=_pow2(D, _MAX_BLOCK_D), BLOCK_H=_pow2(H, _MAX_BLOCK_H),
        )
    return p_exit, cand_prob, local_argmax


def fused_predictor_reference(
    h_normed: torch.Tensor,  # [B, D]
    cand_ids: torch.Tensor,  # [B, K] int64
    lm_head_weight: torch.Tensor,  # [V, D]
    prev_prob: torch.Tensor,  # [B, K]
    w1: torch.Tensor,  # [H, 3K]
    b1: torch.Tensor,  # [H]
    w2: torch.Tensor,  # [1, H]
    b2: torch.Tensor,  # [1]
    draft_prob: torch.Tensor | None = None,  # [B, K]: feature set "zpdq" (w1 [H, 4K])
    record: torch.Tensor | None = None,  # [B, K]: with draft_prob, feature set "zpdqh" (w1 [H, 5K])
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-torch `fused_predictor`: same arguments, same outputs, fp32 math; any device and
    layout. Features and MLP are predictor_features' and exit_probability's (the one definition the engine's CPU
    scorer and the training data use too)."""
    _check_predictor_args(_predictor_named(h_normed, cand_ids, lm_head_weight, prev_prob, w1, b1, w2, b2, draft_prob,
                                           record))
    z = _cand_logits_reference(h_normed.float(), cand_ids, lm_head_weight)  # [B, K]
    features, p = predictor_features(z, prev_prob, draft_prob, record)  # [B, (3 + extra blocks) K], [B, K]
    p_exit = exit_probability(features, LayerPredictor(w1.float(), b1.float(), w2.float(), b2.float()))  # [B]
    local_argmax = cand_ids.gather(1, z.argmax(dim=-1, keepdim=True)).squeeze(1)  # [B]
    return p_exit, p, local_argmax


def predictor_forward(
    h_normed: torch.Tensor,  # [B, D]
    cand_ids: torch.Tensor,  # [B, K] int64
    lm_head_weight: torch.Tensor,  # [V, D]
    prev_prob: torch.Tensor,  # [B, K]
    w1: torch.Tensor,  # [H, 3K]
    b1: torch.Tensor,  # [H]
    w2: torch.Tensor,  # [1, H]
    b2: torch.Tensor,  # [1]
    backend: str = "auto",
    draft_prob: torch.Tensor | None = None,  # [B, K]: feature set "zpdq" (w1 [H, 4K])
    record: torch.Tensor | None = None,  # [B, K]: with draft_prob, feature set "zpdqh" (w1 [H, 5K])
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(p_exit [B], cand_prob [B, K], local_argmax [B]) by the chosen backend: "triton" (the
    kernel; CPU tensors need TRITON_INTERPRET=1), "torch" (the reference), or "auto" (the kernel
    for CUDA tensors when triton is installed, the reference otherwise)."""
    fn = _pick(backend, h_normed.device, fused_predictor, fused_predictor_reference)
    return fn(h_normed, cand_ids, lm_head_weight, prev_prob, w1, b1, w2, b2, draft_prob, record)


# ----------------------------------------------------------------------------- rmsnorm + logits


def rmsnorm_cand_logits(
    h: torch.Tensor,  # [B, D] hidden state before the final norm
    norm_weight: torch.Tensor,  # [D]
    eps: float,
    cand_ids: torch.Tensor,  # [B, K] int64
    lm_head_weight: torch.Tensor,  # [V, D]
) -> torch.Tensor:
    """Triton kernel: z [B, K] fp32 = RMSNorm(h) @ lm_head_weight[cand_ids].T, without
    materializing the normed state. Same input rules as `fused_predictor`."""
    named = dict(h=h, norm_weight=norm_weight, cand_ids=cand_ids, lm_head_weight=lm_head_weight)
    B, D, K = _check_norm_args(named, eps)
    _check_launchable(named)
    z = torch.empty(B, K, dtype=torch.float32, device=h.device)
    if B == 0:
        return z
    with torch.cuda.device(h.device) if h.device.type == "cuda" else contextlib.nullcontext():
        _rmsnorm_cand_logits_kernel[(B,)](
            h, norm_weight, cand_ids, lm_head_weight, z, D, float(eps),
            K=K, BLOCK_K=triton.next_power_of_2(K), BLOCK_D=_pow2(D, _MAX_BLOCK_D),
        )
    return z


def rmsnorm_cand_logits_reference(
    h: torch.Tensor,  # [B, D]
    norm_weight: torch.Tensor,  # [D]
    eps: float,
    cand_ids: torch.Tensor,  # [B, K] int64
    lm_head_weight: torch.Tensor,  # [V, D]
) -> torch.Tensor:
    """Plain-torch `rmsnorm_cand_logits` (fp32 throughout, no rounding back to the input dtype
    between norm and projection, unlike an HF-style RMSNorm module)."""
    _check_norm_args(dict(h=h, norm_weight=norm_weight, cand_ids=cand_ids, lm_head_weight=lm_head_weight), eps)
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(dim=-1, keepdim=True) + eps) * norm_weight.float()  # [B, D]
    return _cand_logits_reference(normed, cand_ids, lm_head_weight)


def _cand_logits_reference(h: torch.Tensor, cand_ids: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
    """z [B, K] fp32 = h [B, D] fp32 @ lm_head_weight[cand_ids].T; index_select and einsum are
    the fastest spelling on CPU (several times faster than advanced indexing and bmm at B=32)."""
    B, K = cand_ids.shape
    rows = lm_head_weight.index_select(0, cand_ids.reshape(-1)).float().view(B, K, -1)  # [B, K, D]
    return torch.einsum("bd,bkd->bk", h, rows)


def cand_logits_forward(
    h: torch.Tensor,  # [B, D]
    norm_weight: torch.Tensor,  # [D]
    eps: float,
    cand_ids: torch.Tensor,  # [B, K] int64
    lm_head_weight: torch.Tensor,  # [V, D]
    backend: str = "auto",
) -> torch.Tensor:
    """z [B, K] by the chosen backend, with the same rule as `predictor_forward`."""
    fn = _pick(backend, h.device, rmsnorm_cand_logits, rmsnorm_cand_logits_reference)
    return fn(h, norm_weight, eps, cand_ids, lm_head_weight)


def _check_norm_args(named: dict[str, torch.Tensor], eps: float) -> tuple[int, int, int]:
    B, D, K = _check_cand("h", named)
    _check_shape("norm_weight", named["norm_weight"], (D,))
    _check_float("norm_weight", named["norm_weight"])
    if not eps > 0:
        raise ValueError(f"eps is {eps}; expected a positive float")
    _check_same_device(named)
    return B, D, K


# ----------------------------------------------------------------------------- dispatch


def _pick(backend: str, device: torch.device, kernel: Callable, reference: Callable) -> Callable:
    if backend not in BACKENDS:
        raise ValueError(f"backend is {backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        return kernel if device.type == "cuda" and triton is not None else reference
    return kernel if backend == "triton" else reference

