"""GGUF's block formats in their own bytes (kernels/ggml_blocks.py, kernels/kquant_cpu.cpp): the plain-torch
dequantization equals gguf's bit for bit on random blocks, the C++ dequantization equals it too, and the C++
GEMV / small GEMM equals the reference's dequantize-then-matmul, in the build for this CPU and the AVX2 one."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.ggml_blocks import BLOCK_FORMATS, blocks_linear_reference, dequantize_blocks_reference, random_blocks

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402

FORMATS = tuple(BLOCK_FORMATS)
GGML = {f: GGMLQuantizationType[f.upper()] for f in FORMATS}


def blocks(o: int, i: int, fmt: str, seed: int = 0) -> torch.Tensor:
    return random_blocks(o, i, fmt, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fmt", FORMATS)
def test_reference_dequantization_equals_ggufs_bit_for_bit(fmt):
    n = BLOCK_FORMATS[fmt][0]
    raw = blocks(7, 3 * n, fmt)
    theirs = gguf_quants.dequantize(raw.numpy(), GGML[fmt])
    ours = dequantize_blocks_reference(raw, fmt)
    assert ours.shape == (7, 3 * n)
    assert np.isfinite(theirs).all() and np.abs(theirs).max() > 0
    np.testing.assert_array_equal(ours.numpy(), theirs)


@pytest.mark.parametrize("fmt", FORMATS)
def test_gguf_quantized_blocks_dequantize_alike(fmt):
    """Blocks gguf's own quantizer writes (where it has one), not only random bytes."""
    n = BLOCK_FORMATS[fmt][0]
    w = np.random.default_rng(0).standard_normal((5, 2 * n)).astype(np.float32) * 0.05
    try:
        raw = gguf_quants.quantize(w, GGML[fmt])
    except NotImplementedError:
        pytest.skip(f"gguf has no quantizer for {fmt}")
    np.testing.assert_array_equal(dequantize_blocks_reference(torch.from_numpy(raw), fmt).numpy(),
                                  gguf_quants.dequantize(raw, GGML[fmt]))


@pytest.mark.parametrize("fmt", ["q4_0", "q5_0"])
def test_q4_0_and_q5_0_re_encode_as_q8_0_without_loss(fmt):
    from kernels.ggml_blocks import as_q8_0
    from specee_core.model.quant import QuantWeight, dequantize_reference

    raw = blocks(9, 96, fmt)
    qs, d = as_q8_0(raw, fmt)
    assert torch.equal(dequantize_reference(QuantWeight("q8", qs, d)), dequantize_blocks_reference(raw, fmt))


def test_bad_formats_and_shapes_are_errors_naming_them():
    with pytest.raises(ValueError, match="q3_k"):
        dequantize_blocks_reference(torch.zeros(2, 110, dtype=torch.uint8), "q3_k")
    with pytest.raises(ValueError, match="144"):
        dequantize_blocks_reference(torch.zeros(2, 100, dtype=torch.uint8), "q4_k")


# (rows, out, in): the Q4_1 kernel test's shapes (SmolLM2's 576 / 1536, ragged outputs), in multiples of 256 for
# the super-block formats; rows 1 (decode), 3, 9, 16 and 17 run every activation-row tile (8, 4, then 3 / 2 / 1)
SHAPES = {32: [(1, 64, 96), (3, 131, 160), (16, 576, 576), (17, 49, 1536), (1, 4096, 576), (9, 40, 640)],
          256: [(1, 64, 256), (3, 131, 512), (16, 576, 768), (17, 49, 1536), (1, 4096, 1024), (9, 40, 2048)]}


CASES = [(fmt, s) for fmt in FORMATS for s in SHAPES[BLOCK_FORMATS[fmt][0]]]


@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize("fmt,shape", CASES, ids=[f"{f}-{'x'.join(map(str, s))}" for f, s in CASES])
def test_cpu_kernel_equals_reference(fmt, shape, isa):
    """Every activation-row tile (8, 4, then 3 / 2 / 1) against the reference, in this CPU's build and the
    AVX2 one; the C++ dequantization equal to the reference (and so to gguf's) bit for bit."""
    from kernels.cpu_ext import lowbit_cpu

    ext = lowbit_cpu(avx2_only=isa == "avx2")
    if isa == "avx2":
        assert ext.simd() in ("avx2+fma+f16c", "scalar")
    b, o, i = shape
    raw = blocks(o, i, fmt, seed=b)
    x = torch.randn(b, i, generator=torch.Generator().manual_seed(1))
    ref = blocks_linear_reference(x, raw, fmt)
    got = ext.blocks_linear(x, raw, fmt)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    assert torch.equal(ext.blocks_dequantize(raw, fmt, i), dequantize_blocks_reference(raw, fmt))


def test_cpu_kernel_refuses_what_it_cannot_read():
    from kernels.cpu_ext import lowbit_cpu

    ext = lowbit_cpu()
    x = torch.randn(2, 256)
    with pytest.raises(ValueError, match="q3_k"):
        ext.blocks_linear(x, blocks(4, 256, "q4_k"), "q3_k")
    with pytest.raises(RuntimeError, match="bytes a row"):
        ext.blocks_linear(x, blocks(4, 512, "q4_k"), "q4_k")


# ---- a GGUF with K-quant matrices, loaded in its own blocks (weights="gguf")

def write_kquant_gguf(path, *, layers: int = 3, hidden: int = 256, heads: int = 4, kv_heads: int = 2,
                      ffn: int = 512):
    """A random Llama in GGUF whose matrices are random blocks as a Q4_K_M file mixes them (gguf cannot quantize
    to K-quants): layer 0 q/k/v, o, gate/up Q4_K and down Q6_K; layer 1 q/k Q4_K but v Q6_K (parts of mixed types:
    the fused qkv stays dense), gate/up Q5_0, down Q5_K; layer 2 q/k Q5_0 with v Q8_0 (as Gemma 3's: one Q8_0
    matrix), o Q4_0, gate/up Q5_1, down Q6_K; token_embd Q8_0, output Q6_K."""
    import gguf
    from gguf.quants import quantize

    from tests.test_gguf import gguf_tokens, write_llama_header

    tokens = gguf_tokens()
    vocab, head_dim = len(tokens), hidden // heads
    rng = np.random.default_rng(0)
    gen = torch.Generator().manual_seed(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-kquant-llama")
    write_llama_header(w, tokens, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn)

    def blocks_of(name, o, i, fmt):
        w.add_tensor(name, random_blocks(o, i, fmt, gen).numpy(), raw_dtype=GGML[fmt])

    def norm(name):
        w.add_tensor(name, (1 + rng.standard_normal(hidden) * 0.05).astype(np.float32))

    emb = (rng.standard_normal((vocab, hidden)) * 0.5).astype(np.float32)
    w.add_tensor("token_embd.weight", quantize(emb, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
    norm("output_norm.weight")
    blocks_of("output.weight", vocab, hidden, "q6_k")
    for i in range(layers):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight")
        norm(p + "ffn_norm.weight")
        qk, v, o, gate_up, down = [("q4_k", "q4_k", "q4_k", "q4_k", "q6_k"), ("q4_k", "q6_k", "q4_k", "q5_0", "q5_k"),
                                   ("q5_0", "q8_0", "q4_0", "q5_1", "q6_k")][i]
        blocks_of(p + "attn_q.weight", heads * head_dim, hidden, qk)
        blocks_of(p + "attn_k.weight", kv_heads * head_dim, hidden, qk)
        if v == "q8_0":
            vw = (rng.standard_normal((kv_heads * head_dim, hidden)) * 0.05).astype(np.float32)
            w.add_tensor(p + "attn_v.weight", quantize(vw, GGMLQuantizationType.Q8_0),
                         raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            blocks_of(p + "attn_v.weight", kv_heads * head_dim, hidden, v)
        blocks_of(p + "attn_output.weight", hidden, heads * head_dim, o)
        for part in ("ffn_gate", "ffn_up"):
            blocks_of(p + part + ".weight", ffn, hidden, gate_up)
        blocks_of(p + "ffn_down.weight", hidden, ffn, down)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def kquant_dir(tmp_path_factory):
    from specee_core.model.gguf import convert_gguf

    src = write_kquant_gguf(tmp_path_factory.mktemp("kgguf") / "tiny-kquant.gguf")
    out = tmp_path_factory.mktemp("kconverted") / "tiny-kquant"
    convert_gguf(src, out, progress=False)
    return out


def test_a_kquant_gguf_runs_in_its_own_blocks_with_fp32s_logits(kquant_dir):
    """weights="gguf": the matrices stay in the file's blocks (checked by format), and the logits of a prefill and
    of a decode step after it equal the same model's with every weight dequantized to fp32."""
    from specee_core import load_model
    from specee_core.model.quant import QuantWeight
    from specee_core.model.weight_plan import checkpoint_format

    assert checkpoint_format(kquant_dir)[0] == "gguf"
    native, dense = load_model(kquant_dir, weights="gguf"), load_model(kquant_dir)
    l0, l1, l2 = native.w.layers
    fmts = lambda lw: [getattr(t, "fmt", None) for t in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down)]  # noqa: E731
    assert fmts(l0) == ["q4_k", "q4_k", "q4_k", "q6_k"]
    assert fmts(l1) == [None, "q4_k", "q5_0", "q5_k"]  # q/k Q4_K with v Q6_K: one dense matrix
    assert fmts(l2) == ["q8", "q4_0", "q5_1", "q6_k"]  # q/k Q5_0 with v Q8_0: Q8_0 holds both exactly
    assert isinstance(native.w.lm_head, QuantWeight) and native.w.lm_head.fmt == "q6_k"
    assert native.w.embed.fmt == "q8"
    ids = torch.tensor([[1, 40, 77, 200, 261, 5, 2]])
    with torch.no_grad():
        logits = []
        for model in (native, dense):
            cache = model.new_cache(1, 8)
            pre = model.logits(model.forward(ids, torch.arange(7)[None], cache))
            step = model.logits(model.forward(ids[:, :1], torch.tensor([[7]]), cache))
            logits.append((pre, step))
    for got, want in zip(*logits):
        assert want.abs().max() > 1
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_the_measured_plan_times_the_files_own_blocks_against_dense(kquant_dir, monkeypatch, tmp_path):
    """weights="auto" on a K-quant conversion: "gguf" is the checkpoint's format, timed against the dense matrices
    (both measured), and the plan's choice is the faster of the two."""
    from specee_core.model import weight_plan
    from specee_core.model.config import ModelConfig

    monkeypatch.setenv("SPECEE_CACHE", str(tmp_path))
    config = ModelConfig.from_file(kquant_dir / "config.json")
    cpu = torch.device("cpu")
    ms = weight_plan.measured_steps(config, 1, "gguf", torch.float32, cpu, root=tmp_path)
    assert set(ms) == {("gguf", torch.float32, False), (None, torch.float32, False)}  # fp32: no held bf16 head
    assert all(set(t) == {1, 4} and min(t.values()) > 0 for t in ms.values())
    monkeypatch.setattr(weight_plan, "measured_steps", lambda *a, **k: ms)
    fmt, act, held_head, reason = weight_plan.choose_weights(kquant_dir, config, cpu, torch.float32, 1)
    assert weight_plan.draft_acceptance(kquant_dir) is None  # no head: the one-token step decides
    assert fmt == min(ms, key=lambda v: ms[v][1])[0] and act == torch.float32 and not held_head
    assert "gguf" in reason and all(f"{t[1]:.1f}" in reason for t in ms.values())


def test_the_engine_runs_a_kquant_gguf_in_its_blocks_as_fp32_does(kquant_dir):
    """Greedy tokens over several steps and a ragged batch, weights="gguf" against the fp32 matrices: the kernels
    change only the summation order."""
    from specee_core import SpecEEEngine

    native = SpecEEEngine.from_pretrained(kquant_dir, weights="gguf")
    dense = SpecEEEngine.from_pretrained(kquant_dir, weights="fp32")
    assert native.model.weight_format == "gguf" and native.model.dtype == torch.float32
    prompts = ["the world", "hello the world, hello", "or"]
    a = native.generate(prompts, max_new_tokens=12, mode="dense", ignore_eos=True)
    b = dense.generate(prompts, max_new_tokens=12, mode="dense", ignore_eos=True)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert len({tuple(r.token_ids) for r in a}) > 1  # not one token repeated for every prompt


def test_a_draft_heads_acceptance_weighs_verification_into_the_choice():
    """per_token_ms: without a head the one-token step; with one, a chain of 4 over 1 + a + a^2 + a^3 tokens where
    that is less. The figures are SmolLM2's at 16 rows (q4 blocks against bf16, ms), where the blocks win the step
    and bf16 wins once its head drafts."""
    from specee_core.model.weight_plan import per_token_ms

    q4, bf16 = {1: 38.2, 4: 131.5}, {1: 41.7, 4: 61.9}
    assert per_token_ms(q4, None) < per_token_ms(bf16, None)
    assert per_token_ms(bf16, 0.668) == pytest.approx(61.9 / (1 + 0.668 + 0.668 ** 2 + 0.668 ** 3))
    assert per_token_ms(bf16, 0.668) < per_token_ms(q4, 0.668) == 38.2
    assert per_token_ms(q4, 0.0) == 38.2  # a head that never agrees: the chain commits one token
