"""kernels.predictor: the Triton kernels against their torch references, the references against
float64, the argument checks, and the backend dispatch.

Triton decides interpreter-or-compiler once per process, when it is first imported, so on a
machine without CUDA this module sets TRITON_INTERPRET=1 *before* importing `kernels` (which
imports triton): the kernel tests then run in the interpreter on CPU tensors. With CUDA the
variable is left alone and the same tests run the compiled kernel on the GPU. If triton was
already imported in compiled mode without a GPU (another test module got there first), the
kernel tests skip and say so; the reference, check and dispatch tests still run.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of triton

import kernels.predictor as kp  # noqa: E402  (after the environment variable, on purpose)
from kernels import (  # noqa: E402
    cand_logits_forward,
    fused_predictor,
    fused_predictor_reference,
    predictor_forward,
    rmsnorm_cand_logits,
    rmsnorm_cand_logits_reference,
    triton_mode,
)

REPO = Path(__file__).resolve().parents[2]
DEVICE = "cuda" if HAS_CUDA else "cpu"
KERNEL_RUNS = triton_mode() == "interpreter" or (HAS_CUDA and triton_mode() == "compiled")
needs_kernel = pytest.mark.skipif(
    not KERNEL_RUNS,
    reason=f"triton mode is {triton_mode()!r} without CUDA: triton was imported before this module could "
    "set TRITON_INTERPRET=1; run `TRITON_INTERPRET=1 pytest tests/kernels`",
)
# Kernel and reference read the same inputs and both compute in fp32: they differ only in
# summation order (and the GPU's exp), so the tolerances are fp32-sized whatever the input dtype.
ATOL, RTOL = 2e-5, 1e-4
V = 300


def make_inputs(B: int, D: int, K: int, H: int, dtype: torch.dtype = torch.float32, device: str = "cpu",
                seed: int = 0, first_layer: bool = False) -> list[torch.Tensor]:
    """Predictor arguments with logits of order 1 (softmax not saturated) and distinct candidates."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, D, generator=g)
    lm = torch.randn(V, D, generator=g) * (2 / D**0.5)  # z ~ N(0, 4)
    cand = torch.rand(B, V, generator=g).argsort(dim=-1)[:, :K].contiguous()  # [B, K] distinct per row
    prev = torch.zeros(B, K) if first_layer else torch.softmax(torch.randn(B, K, generator=g), dim=-1)
    w1 = torch.randn(H, 3 * K, generator=g) / (3 * K) ** 0.5
    b1 = torch.randn(H, generator=g) * 0.1
    w2 = torch.randn(1, H, generator=g) / H**0.5
    b2 = torch.randn(1, generator=g) * 0.1
    floats = [t.to(dtype) for t in (h, lm, prev, w1, b1, w2, b2)]
    args = [floats[0], cand, *floats[1:]]
    return [t.to(device) for t in args]


def with_draft_prob(args: list[torch.Tensor], seed: int = 1) -> tuple[list[torch.Tensor], torch.Tensor]:
    """make_inputs' arguments for the feature set "zpdq": w1 widened to [H, 4K], and draft_prob [B, K]."""
    h, cand, lm, prev, w1, b1, w2, b2 = args
    g = torch.Generator().manual_seed(seed)
    B, K, H = cand.shape[0], cand.shape[1], w1.shape[0]
    w1q = (torch.randn(H, K, generator=g) / K**0.5).to(w1)
    q = torch.softmax(torch.randn(B, K, generator=g) * 2, dim=-1).to(prev)
    return [h, cand, lm, prev, torch.cat((w1, w1q), 1).contiguous(), b1, w2, b2], q


def with_record(args: list[torch.Tensor], q: torch.Tensor, seed: int = 2) -> tuple[list[torch.Tensor], torch.Tensor]:
    """with_draft_prob's arguments for the feature set "zpdqh": w1 widened to [H, 5K], and a record [B, K]
    (the last two outcomes, a hit rate, zero-padded as DraftRecord.features gives it)."""
    h, cand, lm, prev, w1, b1, w2, b2 = args
    g = torch.Generator().manual_seed(seed)
    B, K, H = cand.shape[0], cand.shape[1], w1.shape[0]
    w1r = (torch.randn(H, K, generator=g) / K**0.5).to(w1)
    rec = torch.zeros(B, K)
    rec[:, :2] = torch.randint(0, 2, (B, 2), generator=g).float()
    rec[:, 2] = torch.randint(0, 5, (B,), generator=g).float() / 4
    return [h, cand, lm, prev, torch.cat((w1, w1r), 1).contiguous(), b1, w2, b2], rec.to(prev)


def float64_predictor(h, cand, lm, prev, w1, b1, w2, b2, draft_prob=None, record=None):
    """The predictor written out row by row in float64, as the paper states it (with the draft's
    probabilities, and its record, as further feature blocks when given)."""
    p_exit, probs, best = [], [], []
    for r in range(h.shape[0]):
        z = torch.stack([h[r].double() @ lm[i].double() for i in cand[r].tolist()])  # [K]
        p = torch.exp(z - z.max()) / torch.exp(z - z.max()).sum()
        x = torch.cat([z, p, p - prev[r].double()] + [t[r].double() for t in (draft_prob, record) if t is not None])
        hidden = torch.clamp(w1.double() @ x + b1.double(), min=0)  # [H]
        p_exit.append(1 / (1 + torch.exp(-(w2.double()[0] @ hidden + b2.double()[0]))))
        probs.append(p)
        best.append(cand[r, int(torch.argmax(z))])
    return torch.stack(p_exit), torch.stack(probs), torch.stack(best)


# (B, D, K, H, dtype): every K; D not a power of two, below, at and above one 512 chunk; B of
# 1 and of 33 programs; H not a power of two and above one 128 chunk; the real width 512.
KERNEL_CASES = [
    *[(5, 100, k, 64, torch.float32) for k in (1, 2, 3, 4, 8)],
    (5, 48, 4, 64, torch.float32),
    (5, 320, 4, 64, torch.float32),
    (3, 1100, 4, 64, torch.float32),
    (1, 100, 4, 64, torch.float32),
    (33, 48, 4, 64, torch.float32),
    (5, 48, 4, 100, torch.float32),
    (5, 48, 3, 200, torch.float32),
    (5, 320, 4, 512, torch.float32),
    (5, 100, 3, 64, torch.float16),
    (33, 48, 8, 64, torch.float16),
    (5, 1100, 4, 512, torch.float16),
    (5, 100, 4, 64, torch.bfloat16),  # triton 3.9's interpreter runs bf16
]


def case_id(case) -> str:
    B, D, K, H, dtype = case
    return f"B{B}-D{D}-K{K}-H{H}-{str(dtype).removeprefix('torch.')}"


@needs_kernel
@pytest.mark.parametrize("case", KERNEL_CASES, ids=case_id)
def test_kernel_matches_reference(case):
    B, D, K, H, dtype = case
    args = make_inputs(B, D, K, H, dtype, DEVICE, seed=B * 1000 + D + K)
    p_exit, cand_prob, best = fused_predictor(*args)
    ref_exit, ref_prob, ref_best = fused_predictor_reference(*args)
    assert p_exit.shape == (B,) and p_exit.dtype == torch.float32
    assert cand_prob.shape == (B, K) and cand_prob.dtype == torch.float32
    assert best.shape == (B,) and best.dtype == torch.int64
    torch.testing.assert_close(p_exit, ref_exit, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(cand_prob, ref_prob, atol=ATOL, rtol=RTOL)
    assert torch.equal(best, ref_best)


@needs_kernel
@pytest.mark.parametrize("features", ["zpdq", "zpdqh"])
@pytest.mark.parametrize("case", [(5, 100, 4, 64, torch.float32), (33, 320, 3, 512, torch.float32),
                                  (5, 100, 4, 64, torch.float16)], ids=case_id)
def test_kernel_with_given_feature_blocks_matches_reference(case, features):
    """The feature blocks after [z, p, shift]: the draft's probabilities ("zpdq": w1's fourth block) and
    its record ("zpdqh": a fifth)."""
    B, D, K, H, dtype = case
    args, q = with_draft_prob(make_inputs(B, D, K, H, dtype, DEVICE, seed=B + D))
    given = {"draft_prob": q}
    if features == "zpdqh":
        args, given["record"] = with_record(args, q)
    p_exit, cand_prob, best = fused_predictor(*args, **given)
    ref_exit, ref_prob, ref_best = fused_predictor_reference(*args, **given)
    torch.testing.assert_close(p_exit, ref_exit, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(cand_prob, ref_prob, atol=ATOL, rtol=RTOL)
    assert torch.equal(best, ref_best)
    # each block is read, against its own block of w1: other values give other exit probabilities
    other = {"draft_prob": q.flip(-1).contiguous(), "record": (1 - given.get("record", q)).contiguous()}
    for name in given:
        assert not torch.allclose(fused_predictor(*args, **{**given, name: other[name]})[0], p_exit), name


@needs_kernel
def test_kernel_first_layer_and_ties():
    """prev_prob = 0 (first evaluated layer); equal logits pick the first candidate, like torch."""
    B, D, K, H = 2, 48, 3, 64
    _, _, lm, prev, w1, b1, w2, b2 = make_inputs(B, D, K, H, device=DEVICE, first_layer=True)
    # Small integers make every logit exact in fp32, whatever the summation order: z(5) == z(7).
    row = torch.randint(-3, 4, (D,), generator=torch.Generator().manual_seed(0)).float().to(DEVICE)
    lm[5], lm[7], lm[9] = row, row, -row
    h = torch.stack([row, row])  # [B, D]
    cand = torch.tensor([[9, 7, 5], [9, 5, 7]], device=DEVICE)
    out = fused_predictor(h, cand, lm, prev, w1, b1, w2, b2)
    ref = fused_predictor_reference(h, cand, lm, prev, w1, b1, w2, b2)
    assert out[2].tolist() == ref[2].tolist() == [7, 5]
    torch.testing.assert_close(out[0], ref[0], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(out[1], ref[1], atol=ATOL, rtol=RTOL)


@needs_kernel
def test_kernel_empty_batch():
    p_exit, cand_prob, best = fused_predictor(*make_inputs(0, 48, 4, 64, device=DEVICE))
    assert p_exit.shape == (0,) and cand_prob.shape == (0, 4) and best.shape == (0,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("first_layer", [False, True], ids=["shift", "first-layer"])
def test_reference_matches_float64(dtype, first_layer):
    args = make_inputs(7, 100, 4, 512, dtype, seed=3, first_layer=first_layer)
    p_exit, cand_prob, best = fused_predictor_reference(*args)
    want_exit, want_prob, want_best = float64_predictor(*args)
    torch.testing.assert_close(p_exit.double(), want_exit, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(cand_prob.double(), want_prob, atol=1e-5, rtol=1e-4)
    assert torch.equal(best, want_best)


def test_reference_with_draft_prob_matches_float64():
    args, q = with_draft_prob(make_inputs(7, 100, 4, 512, seed=5))
    got = fused_predictor_reference(*args, draft_prob=q)
    want = float64_predictor(*args, draft_prob=q)
    torch.testing.assert_close(got[0].double(), want[0], atol=1e-5, rtol=1e-4)
    assert torch.equal(got[2], want[2])


def test_reference_with_the_drafts_record_matches_float64():
    args, q = with_draft_prob(make_inputs(7, 100, 4, 512, seed=5))
    args, rec = with_record(args, q)
    got = fused_predictor_reference(*args, draft_prob=q, record=rec)
    want = float64_predictor(*args, draft_prob=q, record=rec)
    torch.testing.assert_close(got[0].double(), want[0], atol=1e-5, rtol=1e-4)
    assert torch.equal(got[2], want[2])
    with pytest.raises(ValueError, match="record needs draft_prob"):
        fused_predictor_reference(*args, record=rec)


def test_draft_prob_width_mismatch_is_named():
    """3K weights with draft_prob, and 4K weights without it, are errors naming w1."""
    args = make_inputs(2, 48, 4, 16)
    wide, q = with_draft_prob(args)
    with pytest.raises(ValueError, match=r"w1 has shape \(16, 12\); expected \[H, 4K=16\]"):
        fused_predictor_reference(*args, draft_prob=q)
    with pytest.raises(ValueError, match=r"w1 has shape \(16, 16\); expected \[H, 3K=12\]"):
        fused_predictor_reference(*wide)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_reference_accepts_strided_inputs(dtype):
    """The CPU path must not care about layout: a transposed view gives the same answer."""
    h, cand, lm, prev, w1, b1, w2, b2 = make_inputs(4, 48, 4, 64, dtype)
    lm_strided = lm.t().contiguous().t()
    torch.testing.assert_close(fused_predictor_reference(h, cand, lm_strided, prev, w1, b1, w2, b2),
                               fused_predictor_reference(h, cand, lm, prev, w1, b1, w2, b2))


# ----------------------------------------------------------------------------- rmsnorm + logits


def norm_inputs(B: int, D: int, K: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    h, cand, lm = make_inputs(B, D, K, 8, dtype, device, seed)[:3]
    g = torch.Generator().manual_seed(seed + 1)
    norm_weight = (torch.rand(D, generator=g) + 0.5).to(dtype).to(device)
    return h * 3, norm_weight, 1e-5, cand, lm


@needs_kernel
@pytest.mark.parametrize("case", [(5, 100, 1, torch.float32), (33, 1100, 4, torch.float32),
                                  (5, 320, 8, torch.float16), (5, 48, 3, torch.bfloat16)],
                         ids=lambda c: f"B{c[0]}-D{c[1]}-K{c[2]}-{str(c[3]).removeprefix('torch.')}")
def test_rmsnorm_kernel_matches_reference(case):
    B, D, K, dtype = case
    args = norm_inputs(B, D, K, dtype, DEVICE, seed=D)
    z = rmsnorm_cand_logits(*args)
    assert z.shape == (B, K) and z.dtype == torch.float32
    torch.testing.assert_close(z, rmsnorm_cand_logits_reference(*args), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rmsnorm_reference_matches_float64(dtype):
    h, g, eps, cand, lm = norm_inputs(6, 100, 4, dtype)
    hd = h.double()
    normed = hd / torch.sqrt((hd * hd).mean(dim=-1, keepdim=True) + eps) * g.double()  # [B, D]
    want = torch.stack([lm[cand[r]].double() @ normed[r] for r in range(h.shape[0])])  # [B, K]
    torch.testing.assert_close(rmsnorm_cand_logits_reference(h, g, eps, cand, lm).double(), want,
                               atol=1e-5, rtol=1e-4)


# ----------------------------------------------------------------------------- checks


def _bad(name, make):
    return pytest.param(name, make, id=name + "-" + make.__doc__)


def _as_int32(t):
    """int32"""
    return t.int()


def _as_int64(t):
    """int64"""
    return t.long()


def _extra_col(t):
    """extra-column"""
    return torch.cat([t, t[..., :1]], dim=-1)


def _extra_row(t):
    """extra-row"""
    return torch.cat([t, t[:1]], dim=0)


def _flat(t):
    """flattened"""
    return t.reshape(-1)


def _scalar(t):
    """0-dim"""
    return t.reshape(())


def _meta(t):
    """on-meta-device"""
    return t.to("meta")


BAD_ARGS = [
    _bad("h_normed", _as_int64), _bad("h_normed", _flat),
    _bad("cand_ids", _as_int32), _bad("cand_ids", _extra_row), _bad("cand_ids", _flat),
    _bad("lm_head_weight", _extra_col), _bad("lm_head_weight", _as_int64),
    _bad("prev_prob", _extra_col), _bad("prev_prob", _as_int64),
    _bad("w1", _extra_col), _bad("w1", _flat), _bad("b1", _extra_row), _bad("w2", _flat),
    _bad("w2", _extra_col), _bad("b2", _scalar), _bad("b2", _as_int64), _bad("w1", _meta),
]
ARG_NAMES = ["h_normed", "cand_ids", "lm_head_weight", "prev_prob", "w1", "b1", "w2", "b2"]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name,make", BAD_ARGS)
def test_bad_argument_is_named(name, make, backend):
    """The shape/dtype/device checks run before anything else, on either backend."""
    named = dict(zip(ARG_NAMES, make_inputs(3, 48, 4, 16)))
    named[name] = make(named[name])
    with pytest.raises(ValueError, match=rf"^{name} "):
        predictor_forward(**named, backend=backend)


@needs_kernel
def test_kernel_rejects_non_contiguous():
    named = dict(zip(ARG_NAMES, make_inputs(3, 48, 4, 16, device=DEVICE)))
    named["lm_head_weight"] = named["lm_head_weight"].t().contiguous().t()
    with pytest.raises(ValueError, match="^lm_head_weight is not contiguous"):
        fused_predictor(**named)


def test_bad_backend_and_eps():
    args = make_inputs(2, 48, 4, 16)
    with pytest.raises(ValueError, match="backend is 'cuda'"):
        predictor_forward(*args, backend="cuda")
    h, g, _, cand, lm = norm_inputs(2, 48, 4, torch.float32)
    with pytest.raises(ValueError, match="^eps is 0.0"):
        cand_logits_forward(h, g, 0.0, cand, lm)
    with pytest.raises(ValueError, match="^norm_weight has shape"):
        cand_logits_forward(h, g[:-1], 1e-5, cand, lm)


# ----------------------------------------------------------------------------- dispatch


@pytest.fixture
def spies(monkeypatch):
    """Replaces kernel and reference by recorders, to see which one a backend picks."""
    calls = []
    for fn in ("fused_predictor", "fused_predictor_reference", "rmsnorm_cand_logits",
               "rmsnorm_cand_logits_reference"):
        monkeypatch.setattr(kp, fn, lambda *a, _fn=fn: calls.append(_fn))
    return calls


@pytest.mark.parametrize("backend,want", [("auto", "reference"), ("torch", "reference"), ("triton", "kernel")])
def test_dispatch_on_cpu(spies, backend, want):
    args = make_inputs(2, 48, 4, 16)
    predictor_forward(*args, backend=backend)
    cand_logits_forward(*norm_inputs(2, 48, 4, torch.float32), backend=backend)
    if want == "kernel":
        assert spies == ["fused_predictor", "rmsnorm_cand_logits"]
    else:
        assert spies == ["fused_predictor_reference", "rmsnorm_cand_logits_reference"]


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_dispatch_auto_on_cuda_runs_kernel(spies):
    predictor_forward(*make_inputs(2, 48, 4, 16, device="cuda"))
    assert spies == ["fused_predictor"]


def _run_python(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


SUBPROCESS_CASE = """
import sys, torch
{setup}
import kernels
g = torch.Generator().manual_seed(0)
B, D, K, H, V = 2, 16, 4, 8, 50
args = [torch.randn(B, D, generator=g), torch.randint(0, V, (B, K), generator=g), torch.randn(V, D, generator=g),
        torch.zeros(B, K), torch.randn(H, 3 * K, generator=g), torch.randn(H, generator=g),
        torch.randn(1, H, generator=g), torch.randn(1, generator=g)]
print("mode", kernels.triton_mode())
print("auto", kernels.predictor_forward(*args)[2].tolist() == kernels.fused_predictor_reference(*args)[2].tolist())
try:
    kernels.predictor_forward(*args, backend="triton")
except RuntimeError as e:
    print("triton-error", e)
"""


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-without-interpreter path")
def test_triton_backend_on_cpu_without_interpreter_errors():
    out = _run_python(SUBPROCESS_CASE.format(setup=""))
    assert out.returncode == 0, out.stderr
    assert "mode compiled" in out.stdout and "auto True" in out.stdout
    assert "triton-error the Triton kernel got cpu tensors" in out.stdout


def test_import_without_triton():
    """`import kernels` must work where triton cannot be imported (macOS): the reference runs."""
    out = _run_python(SUBPROCESS_CASE.format(setup='sys.modules["triton"] = None  # import triton -> ImportError'))
    assert out.returncode == 0, out.stderr
    assert "mode None" in out.stdout and "auto True" in out.stdout
    assert "triton-error backend 'triton' needs the triton package" in out.stdout


# ----------------------------------------------------------------------------- real GPU


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("B", [1, 32])
def test_cuda_bf16_llama_shapes(B):
    """The compiled kernel at Llama2-7B shapes (D 4096, V 32000, K 4, H 512) in bf16."""
    g = torch.Generator().manual_seed(B)
    D, Vb, K, H = 4096, 32000, 4, 512
    h = torch.randn(B, D, generator=g)
    lm = torch.randn(Vb, D, generator=g) * (2 / D**0.5)
    cand = torch.rand(B, Vb, generator=g).argsort(dim=-1)[:, :K].contiguous()
    prev = torch.softmax(torch.randn(B, K, generator=g), dim=-1)
    mlp = [torch.randn(H, 3 * K, generator=g) / 12**0.5, torch.randn(H, generator=g) * 0.1,
           torch.randn(1, H, generator=g) / H**0.5, torch.randn(1, generator=g) * 0.1]
    args = [h.bfloat16().cuda(), cand.cuda(), lm.bfloat16().cuda(), prev.cuda(), *[t.bfloat16().cuda() for t in mlp]]
    out = predictor_forward(*args, backend="triton")
    ref = fused_predictor_reference(*args)
    torch.testing.assert_close(out[0], ref[0], atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(out[1], ref[1], atol=1e-4, rtol=1e-3)
    assert torch.equal(out[2], ref[2])
    norm_weight = torch.rand(D, generator=g).bfloat16().cuda() + 0.5
    z = rmsnorm_cand_logits(args[0], norm_weight, 1e-5, args[1], args[2])
    torch.testing.assert_close(z, rmsnorm_cand_logits_reference(args[0], norm_weight, 1e-5, args[1], args[2]),
                               atol=1e-3, rtol=1e-3)
