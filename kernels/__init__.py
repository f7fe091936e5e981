"""Kernels for the hot paths, each beside a plain-torch reference: Triton kernels for CUDA (one op per file:
predictor, lowbit_gemv, kquant_gemv), the CPU kernels in C++ built at first use (cpu_ext: lowbit_cpu.cpp with the
int8, fused-layer and K-quant units it includes), and the references (reference_math, ggml_blocks: llama.cpp's
block formats, byte-exact against the gguf package).

Importing this package never needs triton, and imports it only when a kernel module is asked for
(`from kernels import fused_predictor`, `import kernels.predictor`): the engine imports
kernels.reference_math (torch only) at start, and tests that run the kernels under TRITON_INTERPRET=1
must be the first to import triton.
"""
import importlib

_EXPORTS = {
    "lowbit_linear": "kernels.lowbit_gemv",
    "lowbit_linear_reference": "kernels.lowbit_gemv",
    "blocks_linear": "kernels.kquant_gemv",
    "blocks_linear_reference": "kernels.ggml_blocks",
    "BACKENDS": "kernels.predictor",
    "triton_mode": "kernels.predictor",
    "cand_logits_forward": "kernels.predictor",
    "fused_predictor": "kernels.predictor",
    "fused_predictor_reference": "kernels.predictor",
    "predictor_forward": "kernels.predictor",
    "rmsnorm_cand_logits": "kernels.predictor",
    "rmsnorm_cand_logits_reference": "kernels.predictor",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
