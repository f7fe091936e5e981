"""Our dense engine against transformers' LlamaForCausalLM on the same weights."""
from __future__ import annotations

import pytest
import torch

from specee_core import SpecEEEngine, load_model
from tests.conftest import make_hf_model

PROMPTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\nclass Foo(object):", "x = 1"]

CONFIGS = {
    "mha-tied": dict(heads=4, kv_heads=4, tied=True),
    "gqa-untied": dict(heads=4, kv_heads=2, tied=False),
    "mqa-linear-rope": dict(heads=4, kv_heads=1, tied=True, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "gqa-dynamic-rope": dict(heads=4, kv_heads=2, tied=False, max_pos=16,
                             rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    "gqa-llama3-rope": dict(heads=4, kv_heads=2, tied=True, max_pos=256,
                            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(path, layers=3, hidden=64, **CONFIGS[request.param])
    return hf, SpecEEEngine.from_pretrained(path, dtype="float32")


def test_logits_match_transformers(pair):
    hf, engine = pair
    model = engine.model
    for prompt in PROMPTS:
        ids = torch.tensor([engine.tokenizer(prompt)["input_ids"]])
        ref = hf(input_ids=ids).logits[0]
        cache = model.new_cache(1, ids.shape[1])
        ours = model.logits(model.forward(ids, torch.arange(ids.shape[1])[None], cache))[0]
        torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


def test_greedy_tokens_match_transformers(pair):
    hf, engine = pair
    for prompt in PROMPTS[:2]:
        ids = torch.tensor([engine.tokenizer(prompt)["input_ids"]])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                          eos_token_id=None, pad_token_id=1)[0, ids.shape[1]:]
        ours = engine.generate([prompt], max_new_tokens=12, mode="dense")[0]
        n = len(ours.token_ids)
        assert ours.token_ids == ref.tolist()[:n]
        assert n == 12 or ours.finish_reason == "stop"


def test_ragged_batch_equals_single_prompts(tiny_model_dir):
    engine = SpecEEEngine.from_pretrained(tiny_model_dir, dtype="float32")
    singles = [engine.generate([p], max_new_tokens=10, mode="dense")[0] for p in PROMPTS]
    batched = engine.generate(PROMPTS, max_new_tokens=10, mode="dense")
    for s, b in zip(singles, batched):
        assert s.token_ids == b.token_ids
        assert s.exit_layers == b.exit_layers == [engine.config.num_hidden_layers] * len(b.token_ids)


def test_ragged_prefill_logits_equal_single(tiny_model_dir):
    model = load_model(tiny_model_dir)
    seqs = [torch.randint(2, 8000, (n,)) for n in (5, 11, 8)]
    t = max(len(s) for s in seqs)
    tokens = torch.zeros(3, t, dtype=torch.int64)
    for b, s in enumerate(seqs):
        tokens[b, : len(s)] = s
    lens = torch.tensor([len(s) for s in seqs])
    cache = model.new_cache(3, 32)
    h = model.forward(tokens, torch.arange(t).expand(3, t), cache, n_valid=lens)
    assert cache.lengths.tolist() == [lens.tolist()] * model.num_layers
    for b, s in enumerate(seqs):
        c1 = model.new_cache(1, 32)
        h1 = model.forward(s[None], torch.arange(len(s))[None], c1)
        torch.testing.assert_close(h[b, : len(s)], h1[0], atol=1e-5, rtol=1e-5)


def test_kv_cache_tracks_lengths_per_layer_and_row(tiny_model_dir):
    """A row can skip a layer (gap) and the layer's length for that row stays behind."""
    model = load_model(tiny_model_dir)
    cache = model.new_cache(2, 16)
    ids = torch.randint(2, 8000, (2, 4))
    model.forward(ids, torch.arange(4).expand(2, 4), cache)
    h = model.embed(torch.tensor([[5], [6]]))
    rope = model.rope_for(torch.tensor([[4], [4]]))
    h = model.layer(0, h, rope, cache)  # both rows run layer 0
    model.layer(1, h[1:], (rope[0][1:], rope[1][1:]), cache, rows=torch.tensor([1]))  # row 1 only
    assert cache.lengths[:, 0].tolist() == [5, 4, 4, 4]
    assert cache.lengths[:, 1].tolist() == [5, 5, 4, 4]
    model.write_kv(2, h[:1], (rope[0][:1], rope[1][:1]), cache, rows=torch.tensor([0]))  # propagate for row 0
    assert cache.lengths[2].tolist() == [5, 4]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_close_to_transformers(tmp_path, dtype):
    torch_dtype = getattr(torch, dtype)
    hf = make_hf_model(tmp_path, layers=2, hidden=64, heads=4, kv_heads=2, dtype=torch_dtype)
    engine = SpecEEEngine.from_pretrained(tmp_path, dtype=dtype)
    ids = torch.tensor([engine.tokenizer(PROMPTS[0])["input_ids"]])
    ref = hf(input_ids=ids).logits[0].float()
    model = engine.model
    ours = model.logits(model.forward(ids, torch.arange(ids.shape[1])[None], model.new_cache(1, 32)))[0].float()
    assert model.w.layers[0].wqkv.dtype == torch_dtype
    torch.testing.assert_close(ours, ref, atol=0.1, rtol=0.05)
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_uniform_fast_path_equals_per_row_path(tiny_model_dir):
    """The cache's every-row-at-one-length path (slice writes; no mask for one token; a bottom-right
    causal mask for a chunk after a prefix) gives what the per-row path (index writes, per-row masks)
    gives: forced here by passing the rows explicitly."""
    model = load_model(tiny_model_dir)
    fast, slow = model.new_cache(2, 32), model.new_cache(2, 32)
    all_rows = torch.arange(2)
    prefix = torch.randint(2, 8000, (2, 6))
    for cache, rows in ((fast, None), (slow, all_rows)):
        model.forward(prefix, torch.arange(6).expand(2, 6), cache, rows)
    assert fast.uniform == [6] * model.num_layers and slow.uniform == [6] * model.num_layers
    for t in (1, 3):  # one decode token, then a chunk after the prefix
        ids = torch.randint(2, 8000, (2, t))
        pos = torch.arange(t).expand(2, t) + int(fast.lengths[0, 0])
        a = model.forward(ids, pos, fast)
        b = model.forward(ids, pos, slow, all_rows)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert fast.lengths.tolist() == slow.lengths.tolist() == [[10, 10]] * model.num_layers


def test_fused_rms_norm_and_rope_forms_equal_the_reference_formulas():
    from specee_core.model.model import RMSNorm, rms_norm
    from specee_core.model.rope import apply_rope

    x, w = torch.randn(3, 5, 96), torch.randn(96)
    torch.testing.assert_close(RMSNorm(w, 1e-5)(x), rms_norm(x, w, 1e-5), atol=1e-6, rtol=1e-5)
    for dtype in (torch.bfloat16, torch.float16):  # HF's formula, bit for bit
        xh, wh = (torch.randn(64, 576) * torch.rand(64, 1) * 10).to(dtype), torch.randn(576).to(dtype)
        assert torch.equal(RMSNorm(wh, 1e-5)(xh), rms_norm(xh, wh, 1e-5))
    q, cos, sin = torch.randn(2, 4, 5, 16), torch.randn(2, 1, 5, 16), torch.randn(2, 1, 5, 16)
    rotate_half = torch.cat((-q[..., 8:], q[..., :8]), dim=-1)  # HF's formula with the plain sin
    signed = torch.cat((-sin[..., :8], sin[..., 8:]), dim=-1)
    assert torch.equal(apply_rope(q, cos, signed), q * cos + rotate_half * sin)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                    reason="oneDNN bf16 not available on this CPU")
def test_packed_bf16_linear_is_bit_identical_to_f_linear(tiny_model_dir):
    """The CPU bf16 path's oneDNN-packed weights change the memory layout, not the arithmetic: the
    whole model's logits equal those of plain F.linear, bit for bit, for a prefill and decode steps."""
    import torch.nn.functional as F

    from specee_core.model.model import Linear

    w, b = torch.randn(96, 64).bfloat16(), torch.randn(96).bfloat16()
    lin = Linear(w, b)
    assert lin.pack
    for m in (1, 4, 17):
        x = torch.randn(2, m, 64).bfloat16()
        assert torch.equal(lin(x), F.linear(x, w, b))
    packed, plain = load_model(tiny_model_dir, dtype="bfloat16"), load_model(tiny_model_dir, dtype="bfloat16")
    for linear in [plain.head] + [getattr(l, f) for l in plain.linears for f in ("qkv", "o", "gate_up", "down")]:
        linear.pack = False
    caches = packed.new_cache(2, 32), plain.new_cache(2, 32)
    start = 0
    for t in (17, 1, 3):
        ids = torch.randint(2, 8000, (2, t))
        pos = torch.arange(start, start + t).expand(2, t)
        a, b = (m.logits(m.forward(ids, pos, c)) for m, c in zip((packed, plain), caches))
        assert torch.equal(a, b)
        start += t
    assert packed.head._packed is not None and plain.head._packed is None


def test_ragged_chunk_near_the_end_of_the_cache_writes_only_its_valid_entries():
    """Row 0 nearly full, row 1 short, a chunk of 3 with valid counts [1, 3]: row 0's padding would
    run past the last slot. The valid entries land where they belong; nothing overflows."""
    from specee_core.model.kv_cache import KVCache

    cache = KVCache(num_layers=1, batch=2, num_kv_heads=1, max_len=10, head_dim=2, dtype=torch.float32, device="cpu")
    cache.append(0, None, torch.zeros(2, 1, 8, 2), torch.zeros(2, 1, 8, 2), n_valid=torch.tensor([8, 2]))
    k = torch.arange(12, dtype=torch.float32).view(2, 1, 3, 2) + 1
    keys, values, mask, _ = cache.append(0, None, k, -k, n_valid=torch.tensor([1, 3]))
    assert cache.lengths[0].tolist() == [9, 5]
    assert torch.equal(cache.k[0, 0, 0, 8], k[0, 0, 0]) and torch.equal(cache.v[0, 1, 0, 2:5], -k[1, 0])
    assert keys.shape[2] == mask.shape[-1] == 10
    with pytest.raises(ValueError, match="overflow"):
        cache.append(0, None, k, k, n_valid=torch.tensor([2, 1]))  # row 0 would need 11 slots
