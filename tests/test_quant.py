"""Low-bit weights (specee_core.model.quant): quantizing equals gguf's own reference byte for byte, the
CPU kernel equals the plain-torch reference, SmolLM2's converted weights quantize back into the
GGUF file's own blocks, and every mode runs on every weight format."""
from __future__ import annotations

import os
import re

import numpy as np
import pytest
import torch

from specee_core import SpecEEEngine
from specee_core.model.quant import (HELD_ROW_CANDIDATES, QuantLinear, QuantWeight, dequantize_reference, held_rows,
                                     holds_bf16, linear_reference, quantize)
from tests.conftest import BUNDLED, REPO, add_early_exit_files, make_hf_model

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402

GGML = {"q4": GGMLQuantizationType.Q4_1, "q8": GGMLQuantizationType.Q8_0}
BLOCK_BYTES = {"q4": 20, "q8": 34}


def to_blocks(qw: QuantWeight) -> np.ndarray:
    """qw in llama.cpp's interleaved block layout, uint8 [O, G * bytes per block]: d (m) then qs."""
    o, g = qw.d.shape
    parts = [qw.d.view(torch.uint8).view(o, g, 2)]
    if qw.m is not None:
        parts.append(qw.m.view(torch.uint8).view(o, g, 2))
    parts.append(qw.qs.view(torch.uint8).view(o, g, -1))
    return torch.cat(parts, dim=-1).reshape(o, -1).numpy()


def from_blocks(raw: np.ndarray, fmt: str) -> QuantWeight:
    """The inverse of to_blocks: raw uint8 [O, G * bytes] as llama.cpp writes it."""
    t = torch.from_numpy(np.ascontiguousarray(raw))
    o = t.shape[0]
    blk = t.view(o, -1, BLOCK_BYTES[fmt])
    half = lambda a, b: blk[..., a:b].contiguous().view(torch.float16)[..., 0].contiguous()  # noqa: E731
    if fmt == "q4":
        return QuantWeight("q4", blk[..., 4:].reshape(o, -1).contiguous(), half(0, 2), half(2, 4))
    return QuantWeight("q8", blk[..., 2:].reshape(o, -1).contiguous().view(torch.int8), half(0, 2))


def random_weight(o: int, i: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(o, i, generator=g) * 0.05
    w[0, :32] = 0.0  # an all-zero block: d = 0 must not divide by zero
    w[1, :32] = 0.25  # a constant block
    return w


@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_quantize_equals_ggufs_reference_byte_for_byte(fmt):
    w = random_weight(37, 96)
    ours = quantize(w, fmt)
    theirs = gguf_quants.quantize(w.numpy(), GGML[fmt])  # uint8 [O, G * bytes]
    np.testing.assert_array_equal(to_blocks(ours), theirs)
    np.testing.assert_array_equal(dequantize_reference(ours).numpy(), gguf_quants.dequantize(theirs, GGML[fmt]))


@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_quantization_error_is_small(fmt):
    w = random_weight(64, 256)
    rel = ((dequantize_reference(quantize(w, fmt)) - w).norm() / w.norm()).item()
    assert rel < {"q4": 0.12, "q8": 0.01}[fmt], rel


def test_bad_shapes_and_formats_are_errors_naming_them():
    with pytest.raises(ValueError, match=r"\(8, 40\).*multiple of 32"):
        quantize(torch.zeros(8, 40), "q4")
    with pytest.raises(ValueError, match="'q3'"):
        quantize(torch.zeros(8, 64), "q3")
    with pytest.raises(ValueError, match="weights='int3'"):
        SpecEEEngine.from_pretrained(BUNDLED, dtype="float32", weights="int3")


@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize("fmt", ["q4", "q8"])
@pytest.mark.parametrize("shape", [(1, 64, 96), (3, 131, 160), (16, 576, 576), (17, 49, 1536), (1, 49152, 576)],
                         ids=lambda s: "x".join(map(str, s)))
def test_cpu_kernel_equals_reference(fmt, shape, isa):
    """Every row-tile path (1 row alone, tiles of 4 and the rest) against the reference, in the build
    for this CPU and in a build without AVX-512 (the AVX2 path, which AVX2-only machines run)."""
    from kernels.cpu_ext import lowbit_cpu

    ext = lowbit_cpu(avx2_only=isa == "avx2")
    if isa == "avx2":
        assert ext.simd() in ("avx2+fma+f16c", "scalar")
    b, o, i = shape
    qw = quantize(random_weight(o, i, seed=b), fmt)
    x = torch.randn(b, i, generator=torch.Generator().manual_seed(1))
    ref = linear_reference(x, qw)
    got = ext.q4_linear(x, qw.qs, qw.d, qw.m) if fmt == "q4" else ext.q8_linear(x, qw.qs, qw.d)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(ext.dequantize(qw.qs, qw.d, qw.m), dequantize_reference(qw))  # bit for bit



def test_a_build_killed_mid_way_does_not_hang_the_next(tmp_path):
    """torch waits forever while its build's lock file exists; one left by a killed build is removed under the
    kernel's own flock (which dies with its holder), so the next process loads the module."""
    import shutil
    import subprocess
    import sys

    from kernels.cpu_ext import _build_dir, lowbit_cpu

    name = lowbit_cpu().__name__
    cache = tmp_path / "cache"
    shutil.copytree(_build_dir() / name, cache / "torch_extensions" / name)  # built: loading it needs no compiler
    stale = cache / "torch_extensions" / name / "lock"
    stale.touch()
    code = "from kernels.cpu_ext import lowbit_cpu; print(lowbit_cpu().simd())"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "SPECEE_CACHE": str(cache)},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip(), out.stderr[-2000:]
    assert not stale.exists()


@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize("fmt", ["q4", "q8"])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_an_output_rows_value_does_not_depend_on_where_its_tile_starts(fmt, rows, isa):
    """The kernel adds 16 output rows' lanes together (a transposed tree) and a range's last rows one at a
    time: both must give the same bits, or a row's value would depend on the threads' split of the outputs.
    Output rows 5..43 alone (AVX-512: tiles of 16 from 5 and 21, then a tail of 7; AVX2: 4 tiles of 8, a tail
    of 7) against the same rows of the whole."""
    from kernels.cpu_ext import lowbit_cpu

    ext = lowbit_cpu(avx2_only=isa == "avx2")
    qw = quantize(random_weight(64, 576, seed=rows), fmt)
    part = QuantWeight(fmt, qw.qs[5:44].contiguous(), qw.d[5:44].contiguous(),
                       None if qw.m is None else qw.m[5:44].contiguous())
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(2))

    def run(w):
        return ext.q4_linear(x, w.qs, w.d, w.m) if fmt == "q4" else ext.q8_linear(x, w.qs, w.d)

    assert torch.equal(run(part), run(qw)[:, 5:44])

def int8_activation_case(b: int, i: int) -> torch.Tensor:
    """Random activations [B, I] with the blocks the quantizer must get right: a block of zeros (d_x = 0),
    a block scaled up 1000x, and (I >= 64) a block whose values land exactly on halves (amax 127: d_x = 1)."""
    x = torch.randn(b, i, generator=torch.Generator().manual_seed(b * 1000 + i))
    x[0, :32] = 0.0
    x[-1, -32:] *= 1000.0
    if i >= 64:
        x[0, 32:64] = torch.tensor([127.0, 0.5, -0.5, 2.5, -2.5, 126.5] + [0.25] * 26)
    return x


@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize("fmt", ["q4", "q8"])
@pytest.mark.parametrize("shape", [(1, 64, 96), (5, 131, 160), (11, 40, 32), (16, 576, 576), (17, 576, 1536),
                                   (16, 1536, 576)], ids=lambda s: "x".join(map(str, s)))
def test_int8_activation_kernel_equals_reference(fmt, shape, isa):
    """q4_linear_i8 / q8_linear_i8 (activations quantized per block to int8, integer dot products) against
    the plain-torch reference: the quantized activations bit for bit, y to fp32 summation order (the
    integer block sums are exact). Shapes: one row, rows that leave a partial tile (tiles of 8 on AVX-512,
    4 on 256-bit), O not a multiple of the 16 (8) output lanes, I of one block and not a multiple of 64,
    SmolLM2-135M's 576 / 1536. Both builds: this CPU's (VNNI here) and the plain AVX2 vpmaddubsw path."""
    from kernels.cpu_ext import lowbit_cpu
    from kernels.reference_math import lowbit_linear_i8_reference, quantize_activations_reference

    ext = lowbit_cpu(avx2_only=isa == "avx2")
    if isa == "avx2":
        assert ext.simd_i8() in ("avx2", "scalar")
    b, o, i = shape
    qw = quantize(random_weight(o, i, seed=b), fmt)
    x = int8_activation_case(b, i)
    for got, ref in zip(ext.quantize_rows_i8(x), quantize_activations_reference(x)):
        assert got.dtype == ref.dtype and torch.equal(got, ref)  # qx int8, dx and sx fp32
    ref = lowbit_linear_i8_reference(x, qw.qs, qw.d, qw.m)
    got = ext.q4_linear_i8(x, qw.qs, qw.d, qw.m) if fmt == "q4" else ext.q8_linear_i8(x, qw.qs, qw.d)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    xb = x.bfloat16()  # bf16 activations: quantized from their fp32 values
    assert torch.equal(ext.quantize_rows_i8(xb)[0], quantize_activations_reference(xb)[0])


def test_int8_activations_round_halves_away_from_zero():
    """The rounding rule (ggml's roundf, not torch.round's halves to even) and a zero block's d_x = 0."""
    from kernels.cpu_ext import lowbit_cpu
    from kernels.reference_math import quantize_activations_reference

    x = int8_activation_case(2, 64)
    for qx, dx, sx in (quantize_activations_reference(x), lowbit_cpu().quantize_rows_i8(x)):
        assert qx[0, 32:38].tolist() == [127, 1, -1, 3, -3, 127] and dx[0, 1].item() == 1.0
        assert not qx[0, :32].any() and dx[0, 0].item() == 0.0 and sx[0, 0].item() == 0.0
        assert sx[0, 1].item() == float(qx[0, 32:64].sum())


@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_int8_activations_are_close_to_fp32_activations(fmt):
    """Quantizing the activations is lossy: on random data (SmolLM2's 576 x 576, 16 rows) the result stays
    within 1% (relative Frobenius error; about 0.5% measured) of the fp32-activation kernel's."""
    from kernels.cpu_ext import lowbit_cpu

    ext = lowbit_cpu()
    qw = quantize(random_weight(576, 576), fmt)
    x = torch.randn(16, 576, generator=torch.Generator().manual_seed(3))
    fp32 = ext.q4_linear(x, qw.qs, qw.d, qw.m) if fmt == "q4" else ext.q8_linear(x, qw.qs, qw.d)
    i8 = ext.q4_linear_i8(x, qw.qs, qw.d, qw.m) if fmt == "q4" else ext.q8_linear_i8(x, qw.qs, qw.d)
    rel = ((i8 - fp32).norm() / fp32.norm()).item()
    assert 1e-4 < rel < 0.01, rel  # above 0: the activations really were quantized


@pytest.mark.parametrize("fmt", ["q4", "q8"])
@pytest.mark.parametrize("rows", [2, 5, 11, 16])
def test_bf16_activation_kernel_equals_its_reference(fmt, rows):
    """bf16 activations on several rows: bf16 dot products over the weights rounded to bf16, summed in
    fp32, equal x @ bf16(dequantize(W)).T computed in fp32 (the fp32 path where the CPU has no bf16)."""
    from kernels.cpu_ext import lowbit_cpu

    qw = quantize(random_weight(70, 160, seed=rows), fmt)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(2)).bfloat16()
    w = dequantize_reference(qw)
    ref = x.float() @ (w.bfloat16().float() if lowbit_cpu().has_bf16() else w).T
    torch.testing.assert_close(lowbit_cpu().linear_bf16(x, qw.qs, qw.d, qw.m), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(QuantLinear(qw)(x).float(), ref.bfloat16().float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("path", ["kernel", "dequantize+gemm", "measured"])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_quant_linear_dispatch_equals_reference(rows, path):
    """The fused kernel and dequantize + GEMM (and whichever the measured crossover picks) equal the
    reference, with a bias, for 3-d input and in bf16 activations."""
    from specee_core.model.quant import DENSE_ROW_CANDIDATES, dense_rows

    qw = quantize(random_weight(80, 128), "q4")
    bias = torch.randn(80)
    lin = QuantLinear(qw, bias, dense_rows={"kernel": 1 << 30, "dequantize+gemm": 1, "measured": None}[path])
    assert dense_rows() in DENSE_ROW_CANDIDATES
    x = torch.randn(2, rows, 128)
    torch.testing.assert_close(lin(x), linear_reference(x, qw, bias), rtol=1e-5, atol=1e-5)
    xb = x.bfloat16()
    assert lin(xb).dtype == torch.bfloat16


@pytest.mark.parametrize("fmt", ["q4a8", "q8a8"])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_int8_activation_format_equals_its_reference_at_every_row_count(fmt, rows):
    """A q4a8 / q8a8 weight's linear is the int8-activation kernel at every row count (prefill too: no switch to
    dequantize + GEMM, so a row's numbers do not depend on the rows beside it), with a bias, 3-d and bf16 input;
    the reference quantizes the activations, and differs from fp32 activations' result."""
    from specee_core.model.quant import planes_of

    planes, act8 = planes_of(fmt)
    qw = quantize(random_weight(80, 128), planes)
    qw.act8 = act8
    bias = torch.randn(80)
    lin = QuantLinear(qw, bias)
    x = torch.randn(2, rows, 128)
    want = linear_reference(x, qw, bias)
    torch.testing.assert_close(lin(x), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(lin(x[:, :1]), lin(x)[:, :1])  # with fewer rows beside it: the same numbers
    fp32_acts = QuantWeight(qw.fmt, qw.qs, qw.d, qw.m)
    assert not torch.allclose(want, linear_reference(x, fp32_acts, bias), rtol=0, atol=1e-6)
    assert lin(x.bfloat16()).dtype == torch.bfloat16


@pytest.fixture(scope="module")
def ee_model_dir(tmp_path_factory):
    """A tiny tied model whose matrices all have input dims that are multiples of 32, with early-exit files."""
    path = tmp_path_factory.mktemp("tiny-q")
    make_hf_model(path, layers=4, hidden=64, heads=4, kv_heads=2, tied=True, seed=1, intermediate=160)
    add_early_exit_files(path)
    return path


def test_matrices_that_cannot_be_blocked_stay_dense(tmp_path, caplog):
    make_hf_model(tmp_path, layers=2, hidden=64, heads=4, kv_heads=2, intermediate=184)
    with caplog.at_level("WARNING"):
        e = SpecEEEngine.from_pretrained(tmp_path, dtype="float32", weights="q4")
    assert "2 matrices kept in torch.float32, not q4" in caplog.text and "(64, 184)" in caplog.text
    assert isinstance(e.model.w.layers[0].w_down, torch.Tensor) and isinstance(e.model.w.layers[0].wo, QuantWeight)
    assert len(e.generate(CODE[:1], max_new_tokens=4, mode="dense", ignore_eos=True)[0].token_ids) == 4


@pytest.fixture(scope="module")
def fp32_and_q4_dequantized(tmp_path_factory, ee_model_dir):
    """The tiny model with q4 weights, and an fp32 engine whose matrices are the q4 weights dequantized."""
    q4 = SpecEEEngine.from_pretrained(ee_model_dir, dtype="float32", weights="q4")
    ref = SpecEEEngine.from_pretrained(ee_model_dir, dtype="float32")
    from specee_core.model.model import LayerLinears, DecoderModel

    m, w = ref.model, ref.model.w
    for lw, qlw in zip(w.layers, q4.model.w.layers):
        for f in ("wqkv", "wo", "w_gate_up", "w_down"):
            setattr(lw, f, getattr(qlw, f).dequantize())
    w.embed = w.lm_head = q4.model.w.embed.dequantize()
    ref.model = DecoderModel(m.config, w, m.device, m.dtype)
    return q4, ref


CODE = ["def fibonacci(n):\n    ", "import numpy as np\n\ndef mean(xs):\n    return", "Once upon a time"]


def test_q4_engine_equals_fp32_on_the_dequantized_weights(fp32_and_q4_dequantized):
    """The kernels change only the summation order: greedy tokens equal an fp32 engine run on the
    dequantized weights, over several steps and a ragged batch."""
    q4, ref = fp32_and_q4_dequantized
    assert q4.model.weight_format == "q4"
    a = q4.generate(CODE, max_new_tokens=24, mode="dense", ignore_eos=True)
    b = ref.generate(CODE, max_new_tokens=24, mode="dense", ignore_eos=True)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]


@pytest.mark.parametrize("fmt", ["q4", "q8", "q4a8", "bf16", "q4+bf16"])
def test_every_mode_runs_on_every_format(ee_model_dir, fmt):
    """dense, spec (chain, tree + T3), specee and auto all run; with fp32 or int8 activations the lossless ones
    equal dense (int8: each token's activations quantized on their own, integer products; bf16 activations
    round differently for one row and several: there they only run)."""
    kw = {"bf16": {"dtype": "bfloat16"}, "q4+bf16": {"dtype": "bfloat16", "weights": "q4"}}.get(
        fmt, {"dtype": "float32", "weights": fmt})
    e = SpecEEEngine.from_pretrained(ee_model_dir, threshold=0.5, **kw)
    assert e.model.weight_format == fmt.split("+")[0]
    exact = fmt != "q4+bf16"
    dense = [r.token_ids for r in e.generate(CODE, max_new_tokens=16, mode="dense", ignore_eos=True)]
    for spec in ({"depth": 3}, {"depth": 3, "width": 4, "nodes": 8, "t3": True}):
        out = e.generate(CODE, max_new_tokens=16, mode="spec", ignore_eos=True, spec={"step_budget": None, **spec})
        if exact and not spec.get("t3"):  # T3 exits inside verification: lossy by design
            assert [r.token_ids for r in out] == dense, spec
        assert all(len(r.token_ids) == 16 for r in out)
    auto = [r.token_ids for r in e.generate(CODE, max_new_tokens=16, ignore_eos=True)]
    assert auto == dense if exact else all(len(r) == 16 for r in auto)
    ee = e.generate(CODE, max_new_tokens=16, mode="specee", ignore_eos=True)
    assert all(len(r.token_ids) == 16 for r in ee)


def test_smollm2_quantizes_back_into_the_gguf_files_own_blocks():
    """Every Q4_1 and Q8_0 tensor of the shipped GGUF: the converted directory's fp32 values quantize
    into exactly the file's bytes (q/k rows un-permuted as transformers does), so weights="q4" on that
    directory runs the file's own blocks."""
    from gguf import GGUFReader

    from specee_core.model.gguf import default_gguf_path
    from specee_core.model.loader import read_state_dict
    from tests.test_smollm2 import need_model

    model_dir = need_model()
    cfg = SpecEEEngine.from_pretrained  # noqa: F841 - config read below without loading the engine
    import json

    config = json.loads((model_dir / "config.json").read_text())
    tensors, _ = read_state_dict(model_dir)
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}

    def unpermute(n: int, heads: int) -> torch.Tensor:  # transformers' _reverse_permute_weights on row ids
        return torch.arange(n).reshape(heads, n // heads // 2, 2).swapaxes(2, 1).reshape(n)

    checked = {"Q4_1": 0, "Q8_0": 0}
    for t in GGUFReader(default_gguf_path()).tensors:
        if t.name == "token_embd.weight":
            hf = "model.embed_tokens.weight"
        elif (m := re.match(r"blk\.(\d+)\.(\w+)\.weight", t.name)) and m.group(2) in names:
            hf = f"model.layers.{m.group(1)}.{names[m.group(2)]}.weight"
        else:
            continue
        raw, w = np.array(t.data), tensors[hf]
        if t.name.endswith("attn_q.weight"):
            raw = raw[unpermute(w.shape[0], config["num_attention_heads"]).numpy()]
        if t.name.endswith("attn_k.weight"):
            raw = raw[unpermute(w.shape[0], config["num_key_value_heads"]).numpy()]
        fmt = {"Q4_1": "q4", "Q8_0": "q8"}[t.tensor_type.name]
        np.testing.assert_array_equal(to_blocks(quantize(w, fmt)), raw, err_msg=t.name)
        assert torch.equal(dequantize_reference(from_blocks(raw, fmt)), w), t.name
        checked[t.tensor_type.name] += 1
    assert checked == {"Q4_1": 210, "Q8_0": 1}


@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_fused_layer_pieces_equal_the_unfused_ones(ee_model_dir, isa, monkeypatch):
    """norm + qkv, o + residual and the whole MLP as one kernel call each (hand-written RMSNorm and SiLU)
    equal the plain pieces (torch's ops), in the native build and the AVX2 one."""
    from kernels.cpu_ext import lowbit_cpu
    from specee_core.model import model as model_module
    from specee_core.model.model import FusedLowbitLinears, LayerLinears

    monkeypatch.setattr(model_module, "cpu_kernel", lambda: lowbit_cpu(avx2_only=isa == "avx2"))
    e = SpecEEEngine.from_pretrained(ee_model_dir, dtype="float32", weights="q4")
    m = e.model
    fused = m.linears[1]
    assert isinstance(fused, FusedLowbitLinears)
    plain = LayerLinears(fused.qkv, fused.o, fused.gate_up, fused.down, fused.kv)
    g = torch.Generator().manual_seed(0)
    for n, t in ((1, 1), (3, 5), (2, 64)):  # decode, verify, prefill (the dense-GEMM side of QuantLinear)
        h = torch.randn(n, t, m.config.hidden_size, generator=g)
        o = torch.randn(n, t, m.q_size, generator=g)
        for a, b in ((fused.qkv_normed(h, m.input_norms[1]), plain.qkv_normed(h, m.input_norms[1])),
                     (fused.o_add(o, h), plain.o_add(o, h)), (fused.mlp(h, m.post_norms[1]), plain.mlp(h, m.post_norms[1]))):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["q4", "fp32", "bf16"])
@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_fused_decode_layer_equals_the_layer_op_by_op(isa, fmt, monkeypatch):
    """A whole decode layer in one call (RMSNorm, qkv, RoPE, the K/V written into the cache, attention over
    it, o, the MLP) equals the layer run op by op through torch's RoPE and attention, on SmolLM2's layer
    shapes (9 query heads over 3 K/V heads of 64): one and three rows, at cache lengths 0 to 300, the same for
    every row or not, every cache row or a subset in another order, one new token per row or a draft tree of
    5 being verified (each node sees its ancestors): the same K/V in the cache, the same hidden states up to
    fp32 rounding; and a whole pass with every layer in one call (LayerStack) equals the layers op by op.
    For Q4_1 blocks, dense fp32 matrices and oneDNN-packed bf16 ones; in bf16 every op rounds as torch's bf16
    op does, so the K/V written are the same bits and the hidden states differ only where the attention's fp32
    sums, in another order, round to another bf16."""
    import copy

    from kernels.cpu_ext import lowbit_cpu
    from specee_core.model import model as model_module, weight_plan
    from specee_core.model.config import ModelConfig
    from specee_core.model.model import LayerLinears

    if fmt == "bf16" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("bf16 matrices run fused where oneDNN has native bf16")
    monkeypatch.setattr(model_module, "cpu_kernel", lambda: lowbit_cpu(avx2_only=isa == "avx2"))
    config = ModelConfig(vocab_size=256, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=512)
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
    m = weight_plan.random_model(config, "q4" if fmt == "q4" else None, dtype, torch.Generator().manual_seed(1))
    assert isinstance(m.linears[0], model_module.FusedLowbitLinears if fmt == "q4" else model_module.FusedDenseLinears)
    # hidden states: fp32 up to rounding; bf16 within a few of its roundings (sums of 576 terms, 2 layers)
    close = dict(rtol=1e-5, atol=1e-4) if fmt != "bf16" else dict(rtol=0.02, atol=0.05)
    kv_close = dict(rtol=1e-6, atol=1e-6) if fmt != "bf16" else dict(rtol=0, atol=0)
    plain = copy.copy(m)  # the same weights, every op through torch (no fused layer, no stack)
    plain.linears = [LayerLinears(lin.qkv, lin.o, lin.gate_up, lin.down, lin.kv) for lin in m.linears]
    plain._stackable = False
    g = torch.Generator().manual_seed(0)
    # a tree of 5: root 0; 1 and 2 its children; 3 under 1; 4 under 2 (row r sees its ancestors and itself)
    parents = [-1, 0, 0, 1, 2]
    tree = torch.zeros(5, 5, dtype=torch.bool)
    for j in range(5):
        a = j
        while a >= 0:
            tree[j, a], a = True, parents[a]
    # (cache rows, lengths before the step, rows stepped (None: all), tokens per row)
    cases = [(1, [0], None, 1), (1, [37], None, 1), (3, [300, 300, 300], None, 1), (3, [300, 120, 7], None, 1),
             (1, [0], None, 5), (2, [45, 45], None, 5), (2, [45, 10], None, 5), (4, [9, 30, 2, 17], [3, 1], 1),
             (4, [9, 30, 2, 17], [2, 0], 5)]
    for rows_in_cache, lens, rows, t in cases:
        caches = [model.new_cache(rows_in_cache, 320) for model in (m, plain)]
        longest = max(lens)
        if longest:
            pre = torch.randn(rows_in_cache, longest, config.hidden_size, generator=g).to(dtype)
            rope = m.rope_for(torch.arange(longest).expand(rows_in_cache, longest))
            for cache in caches:  # the same prompt K/V in both, then each row cut to its length
                plain.layer(0, pre, rope, cache)
                cache.truncate(torch.arange(rows_in_cache), torch.tensor(lens))
        sel = torch.arange(rows_in_cache) if rows is None else torch.tensor(rows)
        n = len(sel)
        h = torch.randn(n, t, config.hidden_size, generator=g).to(dtype)
        depth = torch.tensor([0, 1, 1, 2, 2][:t])
        rope = m.rope_for(torch.tensor(lens)[sel][:, None] + depth)
        trees = None if t == 1 else tree.expand(n, t, t)
        rows_arg = None if rows is None else sel
        a = m.layer(0, h, rope, caches[0], rows=rows_arg, tree=trees)  # the fused call
        b = plain.layer(0, h, rope, caches[1], rows=rows_arg, tree=trees)  # torch's ops
        assert caches[0].lengths[0].tolist() == caches[1].lengths[0].tolist()
        assert caches[0].lengths[0][sel].tolist() == (torch.tensor(lens)[sel] + t).tolist()
        torch.testing.assert_close(a, b, **close)
        if fmt == "bf16":  # the same roundings: nearly every element the same bits
            assert (a == b).float().mean() > 0.99
        torch.testing.assert_close(caches[0].k[0], caches[1].k[0], **kv_close)
        torch.testing.assert_close(caches[0].v[0], caches[1].v[0], **kv_close)
    # a whole pass: every layer in one C++ call (LayerStack) equals the layers op by op, rows at different lengths
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=g)
    caches = [model.new_cache(2, 16) for model in (m, plain)]
    for cache in caches:
        plain.forward(ids[:, :6], torch.arange(6).expand(2, 6), cache)
        cache.truncate(torch.arange(2), torch.tensor([6, 4]))
    pos = torch.tensor([[6], [4]]) + torch.tensor([0, 1, 1])
    tree3 = tree[:3, :3].expand(2, 3, 3)
    a = m.forward(ids[:, 6:], pos, caches[0], tree=tree3)
    assert m._stack is not None and caches[0].lengths[:, 0].tolist() == [9, 9]
    b = plain.forward(ids[:, 6:], pos, caches[1], tree=tree3)
    torch.testing.assert_close(a, b, **close)
    torch.testing.assert_close(caches[0].k, caches[1].k, **(kv_close if fmt != "bf16" else close))


@pytest.mark.parametrize("fmt", ["fp32", "bf16"])
def test_grouped_attention_gives_the_per_query_loops_bits(fmt):
    """On AVX-512 the fused layer's attention runs by (row, K/V head): keys scored 16 at a time, transposed, P V
    held in registers; its sums keep the per-query loop's order, so the hidden states are the same bits with it
    on or off: one token per row, a chain, a tree, rows at different lengths."""
    from kernels.cpu_ext import lowbit_cpu
    from specee_core.model import weight_plan
    from specee_core.model.config import ModelConfig

    ext = lowbit_cpu()
    if ext.simd() != "avx512":
        pytest.skip("the grouped path is AVX-512's")
    if fmt == "bf16" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("bf16 matrices run fused where oneDNN has native bf16")
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
    config = ModelConfig(vocab_size=256, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=512)
    m = weight_plan.random_model(config, None, dtype, torch.Generator().manual_seed(1))
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)  # a branching tree
    for batch, t, context, shape in ((1, 1, 37, None), (3, 4, 200, "chain"), (8, 4, 100, "tree"), (2, 1, 16, None)):
        g = torch.Generator().manual_seed(batch * 100 + t)
        x = torch.randn(batch, t, config.hidden_size, generator=g).to(dtype)
        kv = torch.randn(2, *m.new_cache(batch, context + batch + t).k.shape, generator=g)
        lengths = context + torch.arange(batch)
        chunk = None if shape is None else (torch.tril(torch.ones(t, t, dtype=torch.bool)) if shape == "chain" else tree)
        outs = []
        try:
            for grouped in (True, False):
                ext.grouped_attention(grouped)
                cache = m.new_cache(batch, context + batch + t)
                cache.k.copy_(kv[0]), cache.v.copy_(kv[1])
                cache.truncate(torch.arange(batch), lengths)
                with torch.inference_mode():
                    outs.append(m.layers(x, m.rope_for(lengths[:, None] + torch.arange(t)), cache,
                                         tree=None if chunk is None else chunk.expand(batch, t, t)))
        finally:
            ext.grouped_attention(True)
        assert torch.equal(outs[0], outs[1]), (batch, t, shape)


def test_quantization_error_is_measured_at_load(ee_model_dir):
    """A float checkpoint quantized at load reports its relative error (q4 > q8 > 0); float formats none."""
    errs = {f: SpecEEEngine.from_pretrained(ee_model_dir, dtype="float32", weights=f).weights_info()["quant_error"]
            for f in ("q8", "q4")}
    assert 0 < errs["q8"] < errs["q4"] < 0.2, errs
    assert SpecEEEngine.from_pretrained(ee_model_dir, dtype="float32").weights_info()["quant_error"] is None


def test_the_weight_format_timings_are_measured_once_per_machine_and_shape(tmp_path, monkeypatch):
    """weights="auto" times a decode step once per key (machine, shape, dtype, batch, kernel ...) and caches
    them: a second engine start reads them (timing again would fail here), another batch size measures anew."""
    from specee_core.model import weight_plan
    from specee_core.model.config import ModelConfig

    config = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    cpu = torch.device("cpu")
    first = weight_plan.measured_steps(config, 2, "q4", torch.bfloat16, cpu, root=tmp_path)
    held_head = {("q4", torch.float32, True)} if holds_bf16(torch.bfloat16) else set()  # with bf16 units
    assert set(first) == {("q4", torch.float32, False), (None, torch.bfloat16, False)} | held_head
    assert all(set(t) == {1, 4} and min(t.values()) > 0 for t in first.values())

    def timed(*args, **kw):
        raise AssertionError("measured again")

    monkeypatch.setattr(weight_plan, "time_steps", timed)
    assert weight_plan.measured_steps(config, 2, "q4", torch.bfloat16, cpu, root=tmp_path) == first
    with pytest.raises(AssertionError, match="measured again"):
        weight_plan.measured_steps(config, 4, "q4", torch.bfloat16, cpu, root=tmp_path)
    [saved] = (tmp_path / weight_plan.CACHE_FOLDER).glob("*.json")
    saved.write_text("{broken")  # an unreadable cache is measured again, with a warning
    with pytest.raises(AssertionError, match="measured again"):
        weight_plan.measured_steps(config, 2, "q4", torch.bfloat16, cpu, root=tmp_path)


def test_a_prefill_runs_on_held_bf16_copies_and_every_step_after_it_on_the_blocks(ee_model_dir, monkeypatch):
    """hold_for_prefill: prompt chunks multiply by the weights rounded to bf16 (bf16 activations), the decode and
    verification steps by the blocks; so every lossless mode still equals dense (all prefill alike)."""
    from specee_core.model.model import Linear

    engine = SpecEEEngine.from_pretrained(ee_model_dir, dtype="float32", weights="q4")
    model = engine.model
    assert model.hold_for_prefill() == 4 * 2 * 64 * (128 + 64 + 2 * 160 + 160)  # 4 layers: qkv, o, gate_up, down
    lin = model.linears[0].qkv
    x = torch.randn(HELD_ROW_CANDIDATES[-1], 64)  # from held_rows() (measured) on; fewer rows take the kernel
    model.prefilling.on = True
    held = lin(x)
    model.prefilling.on = False
    bf16_engines = Linear(lin.qw.dequantize(torch.bfloat16))  # the bf16 engine's linear over the same rounded weights
    assert torch.equal(held, bf16_engines(x.to(torch.bfloat16)).float())
    assert torch.equal(lin(x), QuantLinear(lin.qw, lin.b)(x))  # off: the kernel, as before holding

    calls = []  # (rows, held?) of every call of a layer's QuantLinear
    plain_call = QuantLinear.__call__
    monkeypatch.setattr(QuantLinear, "__call__", lambda self, x: calls.append(
        (x.numel() // x.shape[-1], self.held_when is not None and self.held_when.on)) or plain_call(self, x))
    text = "hello the world, " * 20  # over HELD_ROW_CANDIDATES[-1] tokens, whatever held_rows() measures
    out = engine.generate([text], max_new_tokens=4, ignore_eos=True, mode="dense")[0]
    prompt = len(engine.encode_prompt(text))
    assert prompt >= held_rows() and {c for c in calls if c[1]} == {(prompt, True)} and (1, False) in calls
    monkeypatch.undo()
    prompts = [text, "the world, the world, the world", "or"]
    dense = engine.generate(prompts, max_new_tokens=12, mode="dense", ignore_eos=True)
    assert dense[0].token_ids[:4] == out.token_ids
    for mode in ("spec", "auto"):
        got = engine.generate(prompts, max_new_tokens=12, mode=mode, ignore_eos=True)
        assert [r.token_ids for r in got] == [r.token_ids for r in dense], mode


def test_a_held_head_computes_every_call_in_bf16_so_every_mode_still_equals_dense(ee_model_dir, monkeypatch):
    """hold_head: every LM head call (one row, a verified chain's rows, a prefill's last tokens) multiplies by the
    head's weights rounded to bf16, as a bf16 engine's head does; spec and auto still equal dense, and the tokens
    differ from the unheld head's only where bf16 rounding does."""
    from specee_core.model.model import Linear

    engine = SpecEEEngine.from_pretrained(ee_model_dir, dtype="float32", weights="q4")
    model, head = engine.model, engine.model.head
    plain = QuantLinear(head.qw, head.b)
    assert model.hold_head() == 2 * head.out_features * head.in_features and model.held_bytes == model.hold_head() / 2
    bf16_engines = Linear(head.qw.dequantize(torch.bfloat16))
    for n in (1, 3):
        x = torch.randn(n, head.in_features)
        assert torch.equal(head(x), bf16_engines(x.to(torch.bfloat16)).float())
        assert not torch.equal(head(x), plain(x))  # the blocks' fp32 kernel, not what the held head computes
    calls = []  # (rows, held?) of every head call
    plain_call = QuantLinear.__call__

    def call(self, x):
        if self is head:
            calls.append((x.numel() // x.shape[-1], self._held_now(x.numel() // x.shape[-1])))
        return plain_call(self, x)

    monkeypatch.setattr(QuantLinear, "__call__", call)
    prompts = ["hello the world, " * 3, "the world, the world, the world", "or"]
    dense = engine.generate(prompts, max_new_tokens=12, mode="dense", ignore_eos=True)
    assert calls and all(held for _, held in calls) and {1, 3} & {n for n, _ in calls}
    for mode in ("spec", "auto"):
        calls.clear()
        got = engine.generate(prompts, max_new_tokens=12, mode=mode, ignore_eos=True)
        assert [r.token_ids for r in got] == [r.token_ids for r in dense], mode
        assert calls and all(held for _, held in calls), mode
