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
    assert not model.fused_layers  # every layer here needs more than the fused Llama kernel does
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


def test_decode_steps_across_the_window_equal_transformers(pair):
    """One token per step past the window, logit for logit (greedy tokens alone would hide an off-by-one window):
    one row (every row at one length: the window's slots alone are attended) and two rows at different lengths
    (per-row masks)."""
    _, hf, engine = pair
    model = engine.model
    seq = torch.tensor([engine.tokenizer(LONG)["input_ids"]])
    with torch.no_grad():
        ref = hf(input_ids=seq).logits[0]  # [T, V]
    for starts in ([3], [3, 10]):
        cache = model.new_cache(len(starts), seq.shape[1])
        for r, s in enumerate(starts):
            model.forward(seq[:, :s], torch.arange(s)[None], cache, rows=torch.tensor([r]))
        for step in range(3 * WINDOW):
            pos = torch.tensor([[s + step] for s in starts])  # [N, 1]
            logits = model.logits(model.forward(seq[0, pos], pos, cache))[:, 0]
            assert float((logits - ref[pos[:, 0]]).abs().max()) < 1e-4, (starts, step)


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
