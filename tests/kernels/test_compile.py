"""The Triton kernels compile for a GPU (sm_90), ahead of time, on this CPU machine.

The kernel tests here run in Triton's interpreter, which executes the Python and accepts some code the
compiler rejects: the fused predictor's feature-block loop once reused a tensor's name, passed every
interpreter test, and failed to compile on the first GPU it met (an H200). Compiling each kernel variant
for a CUDA target (to PTX and a cubin, with the ptxas that ships with triton) needs no GPU, so that class of
bug now fails on CPU too. In a subprocess: the test modules import triton in interpreter mode."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

CASE = """
import inspect
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.lowbit_gemv import BLOCK_B, BLOCK_K, BLOCK_O, _lowbit_gemv_kernel
from kernels.ggml_blocks import BLOCK_FORMATS
from kernels.kquant_gemv import BLOCK_B as KQ_BLOCK_B, BLOCK_K as KQ_BLOCK_K, BLOCK_O as KQ_BLOCK_O, _blocks_gemv_kernel
from kernels.predictor import _MAX_BLOCK_D, _MAX_BLOCK_H, _fused_predictor_kernel, _rmsnorm_cand_logits_kernel

def compile_for_gpu(fn, types, constexprs):
    names = list(inspect.signature(fn.fn).parameters)
    sig = {n: types.get(n, "constexpr") for n in names}
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32))

PTR = "*fp32"
predictor = {n: PTR for n in ("h_ptr", "lm_ptr", "prev_ptr", "x_ptr", "w1_ptr", "b1_ptr", "w2_ptr", "b2_ptr",
                              "p_exit_ptr", "cand_prob_ptr")}
predictor.update(cand_ptr="*i64", argmax_ptr="*i64", D="i32")
for extra in (0, 1, 2):  # feature sets zpd, zpdq, zpdqh
    compile_for_gpu(_fused_predictor_kernel, predictor,
                    dict(K=4, H=512, EXTRA=extra, BLOCK_K=4, BLOCK_D=_MAX_BLOCK_D, BLOCK_H=_MAX_BLOCK_H))
    print("predictor EXTRA", extra, "compiled")
compile_for_gpu(_rmsnorm_cand_logits_kernel, dict(h_ptr=PTR, g_ptr=PTR, cand_ptr="*i64", lm_ptr=PTR, z_ptr=PTR,
                                                  D="i32", eps="fp32"), dict(K=4, BLOCK_K=4, BLOCK_D=_MAX_BLOCK_D))
print("rmsnorm_cand_logits compiled")
for q4, qs in ((True, "*u8"), (False, "*i8")):
    compile_for_gpu(_lowbit_gemv_kernel, dict(x_ptr=PTR, qs_ptr=qs, d_ptr="*fp16", m_ptr="*fp16", y_ptr=PTR,
                                              B="i32", I="i32", O="i32"),
                    dict(Q4=q4, BLOCK_B=BLOCK_B, BLOCK_O=BLOCK_O, BLOCK_K=BLOCK_K))
    print("lowbit_gemv", "q4" if q4 else "q8", "compiled")
for fmt, (n, nbytes) in BLOCK_FORMATS.items():
    compile_for_gpu(_blocks_gemv_kernel, dict(x_ptr=PTR, raw_ptr="*u8", y_ptr=PTR, B="i32", I="i32", O="i32"),
                    dict(FMT=fmt, N=n, NBYTES=nbytes, BLOCK_B=KQ_BLOCK_B, BLOCK_O=KQ_BLOCK_O, BLOCK_K=KQ_BLOCK_K))
    print("kquant_gemv", fmt, "compiled")
"""


def test_every_triton_kernel_compiles_for_a_gpu():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    out = subprocess.run([sys.executable, "-c", CASE], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    for line in ("predictor EXTRA 0", "predictor EXTRA 1", "predictor EXTRA 2", "rmsnorm_cand_logits",
                 "lowbit_gemv q4", "lowbit_gemv q8",
                 *(f"kquant_gemv {fmt}" for fmt in ("q4_0", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k"))):
        assert line in out.stdout, out.stdout
