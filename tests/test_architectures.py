"""Architectures as configuration of one decoder: Mistral, Qwen2, Qwen3, Gemma 3 and Phi-3 against transformers in
fp32 on random tiny configs (logits within 1e-4, greedy tokens through `generate`, ragged batches, prompts and
decodes that cross the sliding windows); the lossless modes without a draft head; SpecEE refused without
predictors; the same from a GGUF file; unknown architectures refused naming the supported ones."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from specee_core import SpecEEEngine, load_model
from specee_core.model.config import ModelConfig
from specee_core.model.gguf import check_gguf
from tests.conftest import BUNDLED, drafting_plan

WINDOW = 8  # the local layers' window: the prompts and decodes below run past it
LONG = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
PROMPTS = ["x = 1", LONG, "import os\nimport sys\n\nclass Foo(object):"]  # 4, 43 and 14 tokens
ARCHS = ("mistral", "qwen2", "qwen3", "gemma3", "phi3")


def hf_classes(arch: str):
    import transformers as tf

    return {"mistral": (tf.MistralConfig, tf.MistralForCausalLM), "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
            "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM), "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
            "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM)}[arch]


def tiny_config(arch: str, *, vocab: int = 8192, layers: int = 4, head_dim: int = 16, window: int | None = WINDOW):
    """Each architecture's switches on: Mistral's window on every layer; Qwen2's biases and a window from layer 1
    (layer 0 full); Qwen3's q/k norms; Gemma 3's everything with local and global layers and its own query scale;
    Phi-3's fused matrices with a window and RoPE on half of each head."""
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=120, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0,
                  eos_token_id=1, pad_token_id=None)
    config_cls, _ = hf_classes(arch)
    if arch == "mistral":
        return config_cls(**common, sliding_window=window)
    if arch == "qwen2":
        return config_cls(**common, use_sliding_window=window is not None, sliding_window=window, max_window_layers=1)
    if arch == "qwen3":
        return config_cls(**common, head_dim=head_dim)
    if arch == "gemma3":
        types = ["sliding_attention" if (i + 1) % 3 else "full_attention" for i in range(layers)]
        return config_cls(**common, head_dim=head_dim, query_pre_attn_scalar=24, sliding_window=window or 4096,
                          layer_types=types)
    return config_cls(**common, sliding_window=window, partial_rotary_factor=0.5)


def make_arch_model(arch: str, config, path=None, seed: int = 0):
    """A random model of config, sharpened so that outputs depend on positions and windows: norm weights and
    biases random (transformers initializes them to constants), attention sharpened through the q/k weights (or the
    q/k norms, which would undo a weight scale), the logits through the LM head. Saved to path when given, with
    the bundled tokenizer."""
    _, model_cls = hf_classes(arch)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    qk_rows = (config.num_attention_heads + config.num_key_value_heads) * head_dim
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # Gemma's are offsets from 1
                p.copy_((0.0 if arch == "gemma3" else 1.0) + 0.2 * torch.randn(p.shape, generator=g))
                if "q_norm" in name or "k_norm" in name:
                    p.add_(1.5)
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith(("q_proj.weight", "k_proj.weight")) and not config.model_type.startswith(("qwen3", "gemma")):
                p.mul_(4.0)
            elif name.endswith("qkv_proj.weight"):
                p[:qk_rows].mul_(4.0)
        (model.model.embed_tokens.weight.mul_(4) if config.tie_word_embeddings else model.lm_head.weight.mul_(8))
    if path is not None:
        model.save_pretrained(path)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(BUNDLED / f, path / f)
    return model


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    n, t = ids.shape
    return model.logits(model.forward(ids, torch.arange(t).expand(n, t), model.new_cache(n, t)))


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, eos_token_id=None,
                      pad_token_id=1)
    return out[0, x.shape[1]:].tolist()


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tmp_path_factory):
    arch = request.param
    path = tmp_path_factory.mktemp(arch)
    hf = make_arch_model(arch, tiny_config(arch), path)
    # prefill in chunks of 16: the long prompt's chunks start past the window (a masked chunk after cached slots)
    return arch, hf, SpecEEEngine.from_pretrained(path, dtype="float32", prefill_chunk=16)


def test_logits_equal_transformers_and_the_window_matters(pair):
    arch, hf, engine = pair
    model = engine.model
    assert model.config.architecture == ("gemma3_text" if arch == "gemma3" else arch)
    # decode steps run each layer in one call of the fused kernel, but for Qwen2's biases and Phi-3's partial RoPE
    assert model.fused_layers == (arch in ("mistral", "qwen3", "gemma3"))
    ids = torch.tensor([engine.tokenizer(LONG)["input_ids"]])
    assert ids.shape[1] > 4 * WINDOW
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    ours = logits_of(model, ids)
    cache = model.new_cache(1, ids.shape[1])  # in chunks of 16: each chunk's queries see the window before it
    chunked = torch.cat([model.logits(model.forward(ids[:, s : s + 16], torch.arange(s, min(s + 16, ids.shape[1]))[None],
                                                    cache)) for s in range(0, ids.shape[1], 16)], dim=1)
    diff = max(float((ours - ref).abs().max()), float((chunked - ref).abs().max()))
    print(f"{arch}: max |logit difference| {diff:.2e} over {ids.shape[1]} positions")
    assert diff < 1e-4
    if model.config.sliding_window is not None:  # the prompt runs past the window, and that changes the outputs
        windows, model.windows = model.windows, [None] * model.num_layers
        try:
            assert float((logits_of(model, ids) - ref).abs().max()) > 1e-2
        finally:
            model.windows = windows


class CountingKernel:
    """The CPU kernel module, its decode_layer calls counted (which layers a pass ran in the fused kernel)."""

    def __init__(self, ext):
        self.ext, self.decode_layers = ext, 0

    def decode_layer(self, *args):
        self.decode_layers += 1
        return self.ext.decode_layer(*args)

    def __getattr__(self, name: str):
        return getattr(self.ext, name)


def count_fused_layers(monkeypatch) -> CountingKernel:
    from specee_core.model import model as model_module
    from specee_core.model.quant import cpu_kernel

    counting = CountingKernel(cpu_kernel())
    monkeypatch.setattr(model_module, "cpu_kernel", lambda: counting)
    return counting


def test_decode_steps_across_the_window_equal_transformers(pair, monkeypatch):
    """One token per step past the window, logit for logit (greedy tokens alone would hide an off-by-one window):
    one row (every row at one length: the window's slots alone are attended) and two rows at different lengths
    (per-row masks); each step's layers in one fused kernel call each where the architecture has them. The windowed
    layers keep their window and 2 slots: a 10-token prompt grows their buffer, and the decode moves each row's
    slots to the front of it again and again (KVCache._compact), at different steps for the two rows."""
    arch, hf, engine = pair
    model = engine.model
    kernel = count_fused_layers(monkeypatch)
    seq = torch.tensor([engine.tokenizer(LONG)["input_ids"]])
    with torch.no_grad():
        ref = hf(input_ids=seq).logits[0]  # [T, V]
    for starts in ([3], [3, 10]):
        cache = model.new_cache(len(starts), seq.shape[1], room=2)
        for r, s in enumerate(starts):
            model.forward(seq[:, :s], torch.arange(s)[None], cache, rows=torch.tensor([r]))
        for step in range(3 * WINDOW):
            pos = torch.tensor([[s + step] for s in starts])  # [N, 1]
            logits = model.logits(model.forward(seq[0, pos], pos, cache))[:, 0]
            assert float((logits - ref[pos[:, 0]]).abs().max()) < 1e-4, (starts, step)
        if any(model.windows):  # the windowed layers hold 10 slots a row, the others every token
            assert cache.window_len == 10 and cache.max_len == seq.shape[1] and int(cache.shift.min()) > 0
            assert cache.row_lengths(None).tolist() == [s + 3 * WINDOW for s in starts]
    assert kernel.decode_layers == (2 * 3 * WINDOW * model.num_layers if model.fused_layers else 0)


def test_windowed_layers_keep_their_window_through_the_engine(pair):
    """Prompt chunks of 4: a windowed layer's buffer holds its window, a chunk and WINDOW_HEADROOM slots a row (76),
    and a 90-token prompt and its decode run past it: greedy tokens equal transformers' in dense mode, in spec mode
    (drafts verified and kept across the moves) and on a second call that takes the prompt's blocks from the prefix
    cache (the windowed layers from its last blocks); the KV budget counts the windowed layers' 76 slots only."""
    from specee_core.decode.core import WINDOW_HEADROOM
    from specee_core.decode.engine import EngineOptions

    arch, hf, engine = pair
    model = engine.model
    if not any(model.windows):
        pytest.skip(f"{arch}: no windowed layer")
    small = SpecEEEngine(model, engine.tokenizer, EngineOptions(prefill_chunk=4, kv_block_size=4))
    prompt = LONG * 2
    ids = small.encode_prompt(prompt)
    assert len(ids) > WINDOW + 4 + WINDOW_HEADROOM
    want = hf_greedy(hf, ids, 12)
    assert small.generate([prompt], max_new_tokens=12, mode="dense", ignore_eos=True)[0].token_ids == want
    again = small.generate([prompt], max_new_tokens=12, mode="dense", ignore_eos=True)[0]
    assert again.token_ids == want and again.cached_prompt_tokens > 2 * WINDOW
    # LONG's blocks are cached, but their windowed K/V had moved out when they were read: a prompt that shares only
    # them prefills anew (a prefix must end in blocks that hold the window)
    other = LONG + "x = 1\n" * 8
    fresh = small.generate([other], max_new_tokens=12, mode="dense", ignore_eos=True)[0]
    assert fresh.token_ids == hf_greedy(hf, small.encode_prompt(other), 12) and fresh.cached_prompt_tokens == 0
    spec = small.generate([prompt * 2], max_new_tokens=16, mode="spec", ignore_eos=True,
                          spec={"proposer": "lookup", "depth": 4})[0]
    assert spec.token_ids == hf_greedy(hf, small.encode_prompt(prompt * 2), 16)
    assert spec.stats["spec_steps"] < 16, "no drafted token was accepted: keep() across a move went untested"
    windowed = sum(1 for w in model.windows if w)
    kv = 2 * model.config.num_key_value_heads * model.config.head_dim * 4  # a layer's K and V for a token, fp32
    dropped = (512 - (WINDOW + 4 + WINDOW_HEADROOM)) * windowed * kv
    assert small.row_bytes(512, 4 + WINDOW_HEADROOM) == small.slot_bytes() * 512 - dropped
    assert small.core.budget.blocks(512) == -(-(small.slot_bytes() * 512 - dropped) // small.core.budget.block_bytes)


def test_the_batch_jobs_stage_equals_transformers(pair, tmp_path):
    """The batch job's engine stage (pipeline.stage.GenerateRows, what each engine actor runs; in this process, no
    Ray) on the architecture's checkpoint: its rows' completions are transformers' greedy tokens."""
    import pyarrow as pa

    from pipeline.stage import GenerateRows, StageConfig

    arch, hf, engine = pair
    hf.save_pretrained(tmp_path)  # the same weights, a folder of its own for the stage
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / f).write_bytes((BUNDLED / f).read_bytes())
    threads = torch.get_num_threads()
    try:  # the stage sets the threads of the process it runs in (an actor's CPUs; 1 outside Ray)
        stage = GenerateRows(StageConfig(model=str(tmp_path), mode="dense", dtype="float32", max_new_tokens=12,
                                         chat=False), "run-1")
        rows = stage(pa.table({"id": ["a", "b"], "prompt": PROMPTS[1:], "input_error": [None, None]})).to_pylist()
    finally:
        torch.set_num_threads(threads)
    for prompt, row in zip(PROMPTS[1:], rows):
        assert row["error"] is None, row["error"]
        expect = hf_greedy(hf, engine.encode_prompt(prompt), 12)
        eos = engine.tokenizer.eos_token_id
        expect = expect[: expect.index(eos)] if eos in expect else expect  # the job stops at EOS
        assert row["completion"] == engine.tokenizer.decode(expect, skip_special_tokens=True), (arch, prompt)


def test_greedy_tokens_equal_transformers_in_a_ragged_batch(pair):
    arch, hf, engine = pair
    got = engine.generate(PROMPTS, max_new_tokens=12, mode="dense", ignore_eos=True)
    for prompt, r in zip(PROMPTS, got):
        assert r.token_ids == hf_greedy(hf, engine.encode_prompt(prompt), 12), (arch, prompt)


def test_lossless_modes_without_a_draft_head_equal_dense_and_specee_is_refused(pair):
    arch, _, engine = pair
    prompts = [LONG + LONG[:40], PROMPTS[2] * 3]  # repetitive: prompt lookup finds continuations
    dense = engine.generate(prompts, max_new_tokens=16, mode="dense", ignore_eos=True)
    spec = engine.generate(prompts, max_new_tokens=16, mode="spec", ignore_eos=True,
                           spec={"proposer": "lookup", "depth": 4})
    assert [r.token_ids for r in spec] == [r.token_ids for r in dense]
    assert sum(r.stats["spec_steps"] for r in spec) < 32, "no drafted token was accepted: verification went untested"
    with drafting_plan(engine):  # auto drafts where lookup proposes, whatever this machine's speed
        auto = engine.generate(prompts, max_new_tokens=16, ignore_eos=True)
    assert [r.token_ids for r in auto] == [r.token_ids for r in dense]
    assert any(k.startswith("depth") for r in auto for k in r.stats["plan_steps"])
    with pytest.raises(ValueError, match="mode='specee' needs predictors"):
        engine.generate(PROMPTS[:1], max_new_tokens=4, mode="specee")


def test_config_defaults_are_the_transformers_classes():
    """config.json as save_pretrained writes it leaves out the fields equal to the class defaults: read, it must
    give what the full config gives (the architecture's defaults table is transformers')."""
    for arch in ARCHS:
        for window in (WINDOW, None):
            config = tiny_config(arch, window=window)
            assert ModelConfig.from_dict(config.to_diff_dict()) == ModelConfig.from_dict(config.to_dict()), arch
        config = hf_classes(arch)[0]()  # every default: no field written at all but the sizes' own
        assert ModelConfig.from_dict(config.to_diff_dict()) == ModelConfig.from_dict(config.to_dict()), arch


def test_an_architecture_the_engine_cannot_run_is_refused_naming_what_it_can(tmp_path):
    from transformers import GPT2Config

    (tmp_path / "config.json").write_text(json.dumps(GPT2Config(n_layer=1).to_dict()))
    with pytest.raises(ValueError, match=r"model_type 'gpt2'.*supported: LlamaForCausalLM \(llama\), .*"
                                         r"Gemma3ForCausalLM \(gemma3_text\), Phi3ForCausalLM \(phi3\)"):
        load_model(tmp_path)
    config = tiny_config("gemma3").to_dict()
    config.update(final_logit_softcapping=30.0)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0 is not supported"):
        load_model(tmp_path)


# ---- GGUF ---------------------------------------------------------------------------------------------------
GGUF_ARCH = {"qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3", "phi3": "phi3"}


def write_gguf(path, arch: str, hf) -> None:
    """hf's tensors under llama.cpp's names for arch (gguf's tensor name map, as llama.cpp's converter writes
    them; Gemma's norms as 1 + w) and the metadata transformers reads for it, in F32 but for a Q8_0 embedding,
    with test_gguf's byte-level tokenizer."""
    import gguf
    from gguf.quants import quantize

    from tests.test_gguf import CHAT_TEMPLATE, MERGES, SPECIALS
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    c = hf.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    tokens = SPECIALS + sorted(bytes_to_unicode().values()) + [m.replace(" ", "") for m in MERGES]
    assert len(tokens) == c.vocab_size
    w = gguf.GGUFWriter(str(path), GGUF_ARCH[arch])
    w.add_name(f"tiny-random-{arch}")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(float(c.rope_parameters.get("rope_theta") or c.rope_parameters["full_attention"]["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if arch == "gemma3":
        w.add_sliding_window(c.sliding_window)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)  # else transformers takes its class default (Phi-3: 32000, outside this vocabulary)
    w.add_chat_template(CHAT_TEMPLATE)
    arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == GGUF_ARCH[arch])
    names = gguf.get_tensor_name_map(arch_enum, c.num_hidden_layers)
    for hf_name, t in hf.state_dict().items():
        base, suffix = hf_name.rsplit(".", 1)
        name = names.get_name(base)
        if name is None:
            continue  # rotary buffers
        data = t.detach().float().numpy()
        if arch == "gemma3" and base.endswith("norm"):
            data = data + 1.0
        if name == "token_embd":
            w.add_tensor(f"{name}.{suffix}", quantize(data, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(f"{name}.{suffix}", np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", list(GGUF_ARCH))
def test_a_gguf_of_each_architecture_loads_as_transformers_reads_it(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    from specee_core.model.gguf import convert_gguf
    from tests.test_gguf import SPECIALS, MERGES

    vocab = len(SPECIALS) + 256 + len(MERGES)
    # the reference is transformers' reading of the file, not this model: it reads Qwen3's head_dim as its class
    # default (128), Gemma 3's layer pattern (every 6th layer global) and query scale as theirs
    head_dim = 128 if arch == "qwen3" else 16
    hf = make_arch_model(arch, tiny_config(arch, vocab=vocab, layers=6 if arch == "gemma3" else 3, head_dim=head_dim))
    path = tmp_path / f"{arch}.gguf"
    write_gguf(path, arch, hf)
    assert check_gguf(path)[0] == GGUF_ARCH[arch]
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    convert_gguf(path, tmp_path / "converted", progress=False)  # what from_pretrained(path) does into its cache
    engine = SpecEEEngine.from_pretrained(tmp_path / "converted", dtype="float32")
    ids = torch.randint(3, vocab, (2, 3 * WINDOW), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(input_ids=ids).logits
    diff = float((logits_of(engine.model, ids) - want).abs().max())
    print(f"{arch} GGUF: max |logit difference| {diff:.2e}")
    assert diff < 1e-4
    if arch == "gemma3":
        assert engine.config.layer_types.count("full_attention") == 1 and engine.config.sliding_window == WINDOW
    prompt = ids[0, :5].tolist()
    got = engine.generate([engine.tokenizer.decode(prompt)], max_new_tokens=12, mode="dense", ignore_eos=True)[0]
    assert got.token_ids == hf_greedy(ref, engine.encode_prompt(engine.tokenizer.decode(prompt)), 12)


# ---- the fused decode layer ---------------------------------------------------------------------------------
@pytest.mark.parametrize("head_dim", [64, 48])  # 64: attention by K/V head on AVX-512; 48: per query everywhere
@pytest.mark.parametrize("weights", ["fp32", "gguf"])
def test_fused_gemma3_layer_equals_the_layer_op_by_op(weights, head_dim):
    """Gemma 3's decode layer in one C++ call (q/k norms, RoPE of the layer's own table, a sliding window, the
    query scale, output norms before each residual add, GeGLU) equals the layer op by op through torch, a local
    and a global layer, with a window (6) shorter than the context: one token per row, a chain and a tree of 5
    (depth 2) being verified, rows at one length and at different ones, a subset of the cache's rows; the K/V
    written equal too. Dense fp32 matrices, and a GGUF's mix (Q4_K / Q6_K / Q5_0 blocks, Q8_0 planes for q/k/v)."""
    import copy

    from specee_core.model import weight_plan
    from specee_core.model.config import ModelConfig
    from specee_core.model.model import DecoderModel, FusedLayerLinears, LayerLinears, ModelWeights
    from specee_core.model.quant import random_weight

    window = 6
    config = ModelConfig(vocab_size=256, hidden_size=256, intermediate_size=480, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=512,
                         architecture="gemma3_text", hidden_act="gelu_pytorch_tanh", norm_offset=True, qk_norm=True,
                         sandwich_norm=True, embed_scale=16.0, query_scale=24 ** -0.5, sliding_window=window,
                         layer_types=["sliding_attention", "full_attention"], rope_theta=1e6, local_rope_theta=1e4)
    g = torch.Generator().manual_seed(1)
    base = weight_plan.random_model(config, None if weights == "fp32" else "gguf", torch.float32, g)
    qkv_rows = (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim
    for lw in base.w.layers:  # norms away from 1 (a swapped or missing norm shows), q/k/v as a GGUF mix keeps them
        for name in ("input_norm", "post_norm", "q_norm", "k_norm", "attn_out_norm", "mlp_out_norm"):
            setattr(lw, name, 1.0 + 0.3 * torch.randn(getattr(lw, name).shape, generator=g))
        if weights == "gguf":
            lw.wqkv = random_weight(qkv_rows, config.hidden_size, "q8", torch.float32, g)
            if head_dim == 64:  # o_proj's input holds super-blocks: Q6_K, as Q4_K_M files keep some
                lw.wo = random_weight(config.hidden_size, 4 * head_dim, "q6_k", torch.float32, g)
    m = DecoderModel(config, ModelWeights(base.w.embed, base.w.layers, base.w.norm, base.w.lm_head), "cpu",
                     torch.float32)
    assert all(isinstance(lin, FusedLayerLinears) for lin in m.linears) and m.windows == [window, None]
    if weights == "gguf":
        assert m.linears[0].formats() == ["", "q6_k" if head_dim == 64 else "q5_0", "q4_k", "q5_0"]
    plain = copy.copy(m)  # the same weights, every op through torch
    plain.linears = [LayerLinears(lin.qkv, lin.o, lin.gate_up, lin.down, lin.kv, act=lin.act) for lin in m.linears]
    parents = [-1, 0, 0, 1, 2]  # a tree of 5: root 0; 1 and 2 its children; 3 under 1; 4 under 2
    tree = torch.zeros(5, 5, dtype=torch.bool)
    for j in range(5):
        a = j
        while a >= 0:
            tree[j, a], a = True, parents[a]
    chain = torch.tril(torch.ones(5, 5, dtype=torch.bool))
    # (cache rows, lengths before the step, rows stepped (None: all), the chunk: None for one token)
    cases = [(1, [0], None, None), (1, [3], None, None), (1, [40], None, None), (3, [40, 40, 40], None, None),
             (3, [40, 9, 2], None, None), (4, [9, 30, 2, 17], [3, 1], None), (1, [0], None, tree),
             (2, [45, 45], None, tree), (2, [45, 4], None, chain), (4, [9, 30, 2, 17], [2, 0], tree)]
    g = torch.Generator().manual_seed(0)
    for layer in (0, 1):
        for rows_in_cache, lens, rows, chunk in cases:
            caches = [model.new_cache(rows_in_cache, 64) for model in (m, plain)]
            longest = max(lens)
            if longest:
                pre = torch.randn(rows_in_cache, longest, config.hidden_size, generator=g)
                rope = m.rope_for(torch.arange(longest).expand(rows_in_cache, longest))
                for cache in caches:  # the same prompt K/V in both, then each row cut to its length
                    plain.layer(layer, pre, rope, cache)
                    cache.truncate(torch.arange(rows_in_cache), torch.tensor(lens))
            sel = torch.arange(rows_in_cache) if rows is None else torch.tensor(rows)
            n, t = len(sel), 1 if chunk is None else 5
            h = torch.randn(n, t, config.hidden_size, generator=g)
            depth = chunk.sum(-1)[:t] - 1 if chunk is not None else torch.zeros(1, dtype=torch.long)
            rope = m.rope_for(torch.tensor(lens)[sel][:, None] + depth)
            trees = None if chunk is None else chunk.expand(n, t, t)
            rows_arg = None if rows is None else sel
            a = m.layer(layer, h, rope, caches[0], rows=rows_arg, tree=trees)  # the fused call
            b = plain.layer(layer, h, rope, caches[1], rows=rows_arg, tree=trees)  # torch's ops
            case = (layer, lens, rows, None if chunk is None else "tree" if chunk is tree else "chain")
            assert caches[0].lengths[layer].tolist() == caches[1].lengths[layer].tolist(), case
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda s: f"{case}: {s}")
            for kv0, kv1 in zip(caches[0].layer_kv(layer), caches[1].layer_kv(layer)):
                torch.testing.assert_close(kv0, kv1, rtol=1e-5, atol=1e-5)
